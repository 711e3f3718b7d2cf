"""What train_ddp.py uses, in the order it uses it: the setup's steps, the config computed once, the LR
rule and schedule, gradient sync, the loss sums and the agreed stops, where training stands
(Progress), what a checkpoint holds (Checkpoint), and the original script's log lines.

The machinery behind these lives in machinery/, a module per concern: launch (ranks, devices, the
process group), errors (the one error protocol), cli (flags and presets), files (atomic writes), lock
(one run per out-dir), checkpoints (files, format, resume checks), records (the run's files), signals
(stop requests). A reader of the recipe rarely needs to open it. One error protocol throughout: a
problem the user can fix is a UserError (exit 2; WriteError, exit 74), raised on every rank at once and
said once by rank 0. Nothing runs at import."""
from __future__ import annotations

import argparse
import inspect
import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from machinery.checkpoints import (Found, check_format, check_room, check_same_model, describe_position,
                                   find_checkpoint, is_best_epoch, load_initial_weights, save_checkpoint)
from machinery.cli import check_args, run_cli
from machinery.errors import EXIT_STOPPED, UserError, WriteError, all_gather, call_and_agree, leave_on_user_error
from machinery.files import write_on_main
from machinery.launch import DistEnv, default_workers, host_name, init_distributed
from machinery.lock import lock_out_dir
from machinery.output import log
from machinery.records import RunFiles
from machinery.signals import STOP_CHECK_EVERY, StopRequest
from machinery.timing import StepLog

__all__ = [  # what the recipe calls, from here or from the machinery
    "run_cli", "init_distributed", "check_args", "lock_out_dir", "find_checkpoint", "make_config", "RunConfig",
    "UserError", "WriteError", "leave_on_user_error", "EXIT_STOPPED", "log", "log_start", "log_epoch", "lr_factor",
    "sync_gradients", "step_stats", "stop_or_checkpoint_mid_epoch", "NO_FORWARD_BUFFER_SYNC", "StopRequest",
    "StepLog", "Progress", "Checkpoint", "RunFiles", "DistEnv", "Found"]


# ------------------------------------------------------------- the config: flags and world, computed once

@dataclass(frozen=True, eq=False)
class RunConfig:
    """Every flag, and what this run makes of them in its world: built once (make_config), read by
    training, --evaluate and bench.py, and stored whole in config.json and every checkpoint. A flag
    reads as an attribute too: cfg.epochs is flags["epochs"]."""
    flags: dict              # every flag, after --recipe and what a resumed checkpoint rules
    world_size: int          # ranks in all
    nodes: int               # hosts they run on
    per_rank_batch: int      # each rank's share of the global --batch-size (rounded up for --evaluate)
    accumulation_steps: int  # micro-steps per optimizer step, each of at most --micro-batch samples
    micro_batch_size: int    # samples per forward and backward on one rank
    eval_batch: int          # test images per forward on one rank: --micro-batch at most, known to fit
    lr: float                # the peak LR: --base-lr carried from --reference-batch-size to --batch-size
    num_workers: int         # DataLoader workers per rank (--loader torch)
    device_type: str         # cuda or cpu
    amp_dtype: torch.dtype | None  # autocast's dtype, or None for full fp32
    ema_decay: float         # --model-ema's decay per optimizer step: --model-ema-decay per reference batch

    def __getattr__(self, name):
        flags = self.__dict__.get("flags")
        if flags is None or name not in flags:
            raise AttributeError(name)
        return flags[name]

    def to_dict(self) -> dict:
        """Flat, as config.json and checkpoints hold it: the flags, then the derived values."""
        derived = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "flags"}
        amp = str(self.amp_dtype).removeprefix("torch.") if self.amp_dtype else None  # "bfloat16", or null
        return {**self.flags, **derived, "amp_dtype": amp}


def make_config(args, env: DistEnv, found: Found | None = None) -> RunConfig:
    """The run's config from the flags (those of `found`, the checkpoint's where it rules, if given) and
    the world. A collective: the ranks count their hosts."""
    args = argparse.Namespace(**found.flags) if found is not None and found.flags else args
    clash = set(vars(args)) & ({f.name for f in fields(RunConfig)} | {"to_dict"})
    if clash:  # a flag named like a derived value would be shadowed by it
        raise ValueError(f"flags named like RunConfig's fields: {sorted(clash)}; rename them in get_args_parser")
    per_rank_batch = -(-args.batch_size // env.world_size)  # --batch-size is global: each rank takes its share
    accum = accumulation_steps(per_rank_batch, args.micro_batch)
    return RunConfig(
        flags=dict(vars(args)), world_size=env.world_size, nodes=len(set(all_gather(host_name()))),
        per_rank_batch=per_rank_batch, accumulation_steps=accum, micro_batch_size=per_rank_batch // accum,
        eval_batch=min(per_rank_batch, args.micro_batch or per_rank_batch), lr=scaled_lr(args.base_lr, args.batch_size,
                                                               args.reference_batch_size, args.lr_scaling),
        num_workers=args.workers if args.workers >= 0 else default_workers(env), device_type=env.device.type,
        amp_dtype=resolve_amp(args.amp, env.device),
        # The average's horizon stays the same in samples whatever the batch: a step of B samples decays it by
        # D^(B / reference batch) (torchvision adjusts its decay for the batch and EMA interval alike).
        ema_decay=args.model_ema_decay ** (args.batch_size / args.reference_batch_size))


def accumulation_steps(per_rank_batch: int, micro_batch) -> int:
    """The fewest micro-steps that split a rank's batch into equal micro-batches of at most
    `micro_batch` samples (None: no cap, one step)."""
    if not micro_batch or micro_batch >= per_rank_batch:
        return 1
    return next(a for a in range(1, per_rank_batch + 1)
                if per_rank_batch % a == 0 and per_rank_batch // a <= micro_batch)


def scaled_lr(base_lr: float, batch_size: int, reference_batch: int, rule: str) -> float:
    """Scale the LR tuned for `reference_batch` to the global batch (Goyal et al. 2017 for linear)."""
    ratio = batch_size / reference_batch
    return base_lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def resolve_amp(amp: str, device: torch.device):
    """The autocast dtype, or None for full fp32."""
    if amp == "auto":
        if device.type != "cuda":
            return None
        # bf16 needs Ampere (8.0) or newer; is_bf16_supported() also says yes where it is only emulated, slowly.
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]


# ------------------------------------------------------------------------- the LR schedule

def lr_factor(start: float, end: float, *, epochs: int, warmup_epochs: float, schedule: str) -> float:
    """Multiplier of the peak LR for a step that trains from `start` to `end`, both in epochs done
    (epoch - 1 + position in the epoch / its samples). Counted in samples, not steps, the schedule
    keeps its place when a resumed run changes the batch size. Linear warm-up, then cosine to 0 at
    the end of training, the WRN paper's steps (x0.2 at 30%, 60% and 80% of training), or constant
    (the original script's)."""
    if start < warmup_epochs:
        return min(1.0, end / warmup_epochs)
    if schedule == "constant":
        return 1.0
    if schedule == "step":
        return 0.2 ** sum(start >= m * epochs - 1e-9 for m in (0.3, 0.6, 0.8))  # 1e-9: 0.8 * 7 is 5.6000000000000005
    progress = (start - warmup_epochs) / max(epochs - warmup_epochs, 1e-9)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# ------------------------------------------------------------------ the gradient all-reduce, and the loss sums

# DDP's option that turns off its broadcast of the buffers before every forward: forward_sync_buffers since torch
# 2.14 (broadcast_buffers, which older versions have, is deprecated there).
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})


def sync_gradients(model, enabled: bool):
    """A context for one backward: DDP all-reduces the gradients in it if `enabled`, and else only
    accumulates them locally (DDP's no_sync), through torch.compile's wrapper; a no-op without DDP."""
    ddp = getattr(model, "_orig_mod", model)
    return ddp.no_sync() if not enabled and isinstance(ddp, DDP) else nullcontext()


EPOCH_SUMS = 6  # loss * n over finite losses, their n, all n; gradient norm over finite norms, their steps, all steps


def step_stats(loss_sum: torch.Tensor | None = None, n: int = 0, *, grad_norm: torch.Tensor | None = None):
    """A share of the epoch's sums (EPOCH_SUMS): a micro-batch's, from its summed loss over n samples (the
    loss sum if finite, n if it is, and n), or a step's clipped gradient norm (the norm if finite, 1 if it
    is, and 1), counted on rank 0 alone: every rank has the same norm, and the sums are all-reduced. Device
    tensors only, so nothing waits for the GPU."""
    value = loss_sum if grad_norm is None else grad_norm
    finite = torch.isfinite(value).double()
    zero = torch.zeros(3, dtype=torch.float64, device=value.device)
    if grad_norm is None:
        return torch.cat([torch.stack([torch.where(finite > 0, value.double(), 0.0), finite * n, finite * 0 + n]), zero])
    rank0 = float(not dist.is_initialized() or dist.get_rank() == 0)
    return torch.cat([zero, torch.stack([torch.where(finite > 0, value.double(), 0.0), finite, finite * 0 + 1])
                      * rank0])


def stop_or_checkpoint_mid_epoch(progress, sums: torch.Tensor, *, t0: float, cfg, stop, checkpoint, loader,
                                 allow_nonfinite: bool) -> bool:
    """Every STOP_CHECK_EVERY steps the ranks agree whether to stop (a signal, the stop file), check the
    loss and the samples the loader could not read (loader.check: skipped, or UserError); a stop, or
    --checkpoint-every, saves a checkpoint mid-epoch. True if the ranks stop now."""
    step = progress.step
    checkpoint_due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
    if step % STOP_CHECK_EVERY and not checkpoint_due:
        return False
    loader.check()  # before any checkpoint: what it trained without is agreed on, named and counted
    stopping = stop.check(sums.device, sums, allow_nonfinite)  # all ranks agree
    if stopping or checkpoint_due:
        progress.elapsed_s = time.perf_counter() - t0
        total = sums.clone()
        if dist.is_initialized():
            dist.all_reduce(total)  # the epoch's sums so far, over all ranks, for the checkpoint
        progress.sums = total.tolist()
        checkpoint.save(progress)
    if stopping:
        stop.say_stopped(f"Stop requested ({stop.reason}) in epoch {progress.epoch + 1} after step {step}: "
                         f"checkpoint saved in {cfg.out_dir}; exiting with status {EXIT_STOPPED} to be resumed.")
    return stopping


# ------------------------------------------------------------------------- where training stands

@dataclass
class Progress:
    """Where training stands. Saved in every checkpoint, so a run resumes mid-epoch exactly."""
    epoch: int = 0              # epochs completed
    position: int = 0           # samples of epoch + 1's order trained so far (global, all ranks)
    step: int = 0               # steps taken in epoch + 1 (for the progress lines and --checkpoint-every)
    sums: list = field(default_factory=lambda: [0.0] * EPOCH_SUMS)  # that epoch so far (step_stats)
    elapsed_s: float = 0.0      # that epoch's training time so far
    history: list = field(default_factory=list)  # one metrics dict per completed epoch
    total_time_s: float = 0.0
    total_images: int = 0
    stopped_early: bool = False
    skipped: list = field(default_factory=list)  # that epoch's unreadable samples skipped so far (AgreedLoader)

    def epochs_left(self, epochs: int) -> range:
        """The epochs still to train, the first maybe begun: none once early stopping ended the run."""
        return range(self.epoch + 1, epochs + 1) if not self.stopped_early else range(0)

    def finish_epoch(self, epoch: int, val: dict, *, lr: float, cfg, timing: dict) -> dict:
        """Close a trained and evaluated epoch: its row of metrics.jsonl (the all-reduced training loss
        and samples, the test metrics, the LR of its last step, its time, and `timing`: every rank's
        split of its step time, from StepLog.finish_epoch), kept in the history; decide
        early stopping (from the all-reduced accuracy, so every rank decides alike); the next epoch
        starts at its beginning. Returns the row."""
        loss_sum, n_finite, count, norm_sum, norm_steps, steps = self.sums
        metrics = {"epoch": epoch, "train_loss": loss_sum / max(n_finite, 1), "train_samples": int(count), **val,
                   "lr": lr, "epoch_time_s": self.elapsed_s, "images_per_s": count / self.elapsed_s}
        if n_finite < count:  # fp16: samples whose loss was not finite, in steps the scaler skipped
            metrics["nonfinite_samples"] = int(count - n_finite)
        if steps:  # --clip-grad-norm: the mean norm before clipping, and the steps skipped for a non-finite one
            metrics["grad_norm"] = norm_sum / max(norm_steps, 1)
            metrics["nonfinite_grad_steps"] = int(steps - norm_steps)
        if cfg.flags.get("model_ema"):
            metrics["scored"] = "model_ema"  # the test (and validation) metrics are the weight EMA's
        metrics["skipped_samples"] = len(self.skipped)  # unreadable, skipped (--skip-bad-samples); named in the log
        metrics.update(timing)
        self.history.append(metrics)
        recent = [m["val_acc"] for m in self.history[-cfg.patience:]]
        self.stopped_early = len(recent) == cfg.patience and min(recent) >= cfg.target_accuracy
        self.epoch, self.position, self.step = epoch, 0, 0
        self.total_time_s += self.elapsed_s
        self.total_images += int(count)
        self.sums, self.elapsed_s, self.skipped = [0.0] * EPOCH_SUMS, 0.0, []
        return metrics


# ------------------------------------------------------------------------- what a checkpoint holds

class Checkpoint:
    """What a checkpoint holds, registered once; saving, restoring, sizing and the resume checks go over it.

    `state` (keywords: name=object with state_dict() and load_state_dict()) is required: a checkpoint
    without one is refused as an older version's. State an option adds later goes in with add(), which
    says what stands in for it when a checkpoint written before the option has none: so old checkpoints
    still resume, and nothing is guessed silently. Besides the state a checkpoint holds where training
    stands (Progress), the config, the model's config and the data's fingerprints (a resume must match
    them), and every rank's RNG states (machinery/checkpoints.py: REQUIRED_KEYS)."""

    def __init__(self, cfg: RunConfig, env: DistEnv, data, *, model_config: dict, lock=None, **state):
        self.cfg, self.env, self.data, self.model_config, self.lock = cfg, env, data, model_config, lock
        self.required = state     # name -> object
        self.optional = {}        # name -> (object, what stands in when absent, a function that sets it)

    def add(self, name: str, obj, *, when_absent: str, start_absent=lambda: None) -> None:
        """Register optional state: saved and restored like the rest; a checkpoint without it resumes, with
        start_absent() called and a note saying `when_absent` (e.g. "the average starts from the weights").
        None (an option that is off) registers nothing."""
        if obj is not None:
            self.optional[name] = (obj, when_absent, start_absent)

    def objects(self) -> dict:
        return {**self.required, **{name: obj for name, (obj, _, _) in self.optional.items()}}

    def restore(self, found: Found) -> Progress:
        """Load the checkpoint's state into the registered objects; say what changed. Returns where
        training stands: the checkpoint's Progress, or a new one (epoch 0) for a new run, which starts
        from --init-from's weights if given (the model's only: the rest starts afresh)."""
        if found.ckpt is None:
            if self.cfg.flags.get("init_from") and not self.cfg.evaluate:
                log(call_and_agree(load_initial_weights, self.required["model"], self.cfg.init_from))
            return Progress()
        ckpt, cfg, env = found.ckpt, self.cfg, self.env
        check_format(ckpt, found.path, required=self.required)
        check_same_model(found, self.model_config)
        for name, obj in self.required.items():
            if ckpt[name]:  # empty: nothing to restore (a GradScaler that was off)
                obj.load_state_dict(ckpt[name])
        for name, (obj, when_absent, start_absent) in self.optional.items():
            if name in ckpt:
                obj.load_state_dict(ckpt[name])
            else:
                start_absent()
                log(f"note: {found.path} holds no {name} (written before it was added): {when_absent}")
        saved, progress = ckpt["config"], Progress(**ckpt["progress"])
        progress.sums += [0.0] * (EPOCH_SUMS - len(progress.sums))  # a checkpoint from before the gradient norm
        if not cfg.evaluate:
            note_resume_changes(saved, cfg, progress)
        progress.step = -(-progress.position // cfg.batch_size)
        if ckpt["world_size"] == env.world_size:  # else the seeding at build time serves as well as any
            torch.set_rng_state(ckpt["rng_cpu"][env.rank].cpu())
            if env.device.type == "cuda" and ckpt["rng_cuda"]:
                torch.cuda.set_rng_state(ckpt["rng_cuda"][env.rank].cpu(), env.device)
        if not cfg.evaluate:
            rest = f", and {progress.position} samples ({progress.step} steps) of the next" if progress.position else ""
            log(f"Resumed from {found.path}: epoch {progress.epoch} of {cfg.epochs} done{rest}.")
        return progress

    def check_room(self) -> None:
        """Refuse to start when the out-dir has no room for the next checkpoint, sized by what it will hold
        (an optimizer's state included before its first step), and best.pt beside it with --val-size. Rank 0
        checks; every rank raises."""
        copies = 2 if self.cfg.flags.get("val_size") else 1
        call_and_agree(check_room, self.cfg.out_dir, self.objects(), copies=copies, here=self.env.is_main)

    def save(self, progress: Progress) -> None:
        """Write a checkpoint. Every rank calls this (it gathers their RNG states); rank 0 writes, unless
        another run took the out-dir, and all ranks leave together if that write fails."""
        rng_cpu = all_gather(torch.get_rng_state())
        rng_cuda = all_gather(torch.cuda.get_rng_state(self.env.device)) if self.env.device.type == "cuda" else []
        state = {**{name: obj.state_dict() for name, obj in self.objects().items()},
                 "progress": asdict(progress), "config": {**self.cfg.to_dict(), "data_spec": asdict(self.data.spec)},
                 "model_config": self.model_config, "data": self.data.fingerprints,
                 "world_size": len(rng_cpu), "rng_cpu": rng_cpu, "rng_cuda": rng_cuda}
        out_dir, what = self.cfg.out_dir, f"the checkpoint {describe_position(**asdict(progress))}"
        # With a validation split (--val-size), an epoch's end with the best validation accuracy so far is also best.pt.
        best = bool(self.cfg.flags.get("val_size")) and not progress.position and is_best_epoch(progress.history)
        write_on_main(self.env, lambda: save_checkpoint(out_dir, state, self.cfg.keep_checkpoints, best=best),
                      what=what, out_dir=out_dir, lock=self.lock)


def note_resume_changes(saved: dict, cfg: RunConfig, progress: Progress) -> None:
    """The notes a resumed run's log opens with: what changed in the batch and the LR."""
    if saved["lr"] != cfg.lr:
        log(f"note: the peak LR changed from {saved['lr']:.4g} to {cfg.lr:.4g} on resume")
    if saved["batch_size"] != cfg.batch_size:
        log(f"note: the global batch changed from {saved['batch_size']} to {cfg.batch_size} on resume: the "
            f"schedule keeps its place in samples (epoch {progress.epoch + 1} resumes at sample {progress.position})")
    before = (saved["world_size"], saved["accumulation_steps"], saved["micro_batch_size"])
    if before != (cfg.world_size, cfg.accumulation_steps, cfg.micro_batch_size):
        same = "the same global batch" if saved["batch_size"] == cfg.batch_size else "another global batch"
        log(f"note: {before[0]} ranks x {before[1]} accumulation steps x {before[2]} before, {cfg.world_size} x "
            f"{cfg.accumulation_steps} x {cfg.micro_batch_size} now: {same} ({saved['batch_size']} before, "
            f"{cfg.batch_size} now)")


# ------------------------------------------------------------------------- the original script's lines

def log_start(cfg: RunConfig, env: DistEnv, data, found: Found, *, parser) -> None:
    """The original script's first two lines, then the flags that differ from their defaults in `parser`,
    the batch split and the LR, the data, and notes on what a resumed run changes."""
    unit = "GPUs" if env.device.type == "cuda" else "CPU processes"
    log(f"Training started with {env.world_size} processes across {cfg.nodes} nodes.")
    log(f"Using {env.local_world_size} {unit} per node.")
    changed = {k: v for k, v in cfg.flags.items() if parser.get_default(k) != v and k not in found.kept}
    kept = "".join(f", and the checkpoint's --{k.replace('_', '-')} {cfg.flags[k]}" for k in sorted(found.kept))
    log(f"Config: {json.dumps(changed)} (the rest: the defaults{kept}; all of it in {cfg.out_dir}/config.json)")
    split = (f"{env.world_size} ranks x {cfg.accumulation_steps} accumulation steps x {cfg.micro_batch_size}"
             if cfg.accumulation_steps > 1 else f"{env.world_size} ranks x {cfg.per_rank_batch}")
    rule = ("--base-lr as given, --lr-scaling none" if cfg.lr_scaling == "none" else
            f"{cfg.lr_scaling} scaling of {cfg.base_lr:g} from batch {cfg.reference_batch_size}")
    log(f"Global batch {cfg.batch_size} = {split}; LR {cfg.lr:.4g} ({rule}; {cfg.lr_schedule} after "
        f"{cfg.warmup_epochs:g} warm-up epochs)")
    spec = data.spec
    log(f"Data: {len(data.train)} training and {len(data.test)} test images of {spec.channels} x {spec.height} x "
        f"{spec.width}, {spec.num_classes} classes; per-channel mean {tuple(round(m, 4) for m in spec.mean)}, "
        f"std {tuple(round(s, 4) for s in spec.std)}")
    for note in [*found.notes, *flag_notes(cfg, found.ckpt)]:
        log(f"note: {note}")


def flag_notes(cfg, ckpt: dict | None = None) -> list:
    """What the flags do that a user probably did not mean, each in a line: the LR rule training far below
    --base-lr for a small batch, a warm-up that takes most of a short run, and a resume with another --epochs
    that sends the schedule's LR back up (`ckpt`: the checkpoint resumed, if any)."""
    notes = []
    if ckpt is not None and ckpt["config"]["epochs"] != cfg.epochs and cfg.lr_schedule != "constant":
        at, before = ckpt["progress"]["epoch"], ckpt["config"]["epochs"]  # epochs done, the run's length so far

        def lr(epochs):
            return cfg.lr * lr_factor(at, at, epochs=epochs, warmup_epochs=cfg.warmup_epochs, schedule=cfg.lr_schedule)
        if lr(cfg.epochs) > 1.5 * lr(before):
            notes.append(f"--epochs {before} -> {cfg.epochs} stretches the {cfg.lr_schedule} schedule: after epoch {at} "
                         f"the LR goes back up from {lr(before):.4g} to {lr(cfg.epochs):.4g}; to fine-tune at a low LR "
                         f"instead, start a new run from these weights (--init-from) with its own schedule")
    if cfg.lr_scaling != "none" and cfg.lr <= cfg.base_lr / 4:
        notes.append(f"--batch-size {cfg.batch_size} is far below --reference-batch-size {cfg.reference_batch_size}, so "
                     f"{cfg.lr_scaling} scaling trains at LR {cfg.lr:.4g}, {cfg.base_lr / cfg.lr:.3g}x below --base-lr "
                     f"{cfg.base_lr:g}; to train at --base-lr as given, add --lr-scaling none (or --reference-batch-size "
                     f"{cfg.batch_size})")
    if cfg.warmup_epochs and cfg.warmup_epochs >= cfg.epochs / 2:
        notes.append(f"{cfg.warmup_epochs:g} of the {cfg.epochs} epochs warm up (--warmup-epochs {cfg.warmup_epochs:g}): "
                     f"the LR peaks only at epoch {min(cfg.warmup_epochs, cfg.epochs):g}; for a short run, lower "
                     f"--warmup-epochs")
    return notes


def log_epoch(metrics: dict, epochs: int) -> None:
    """The original script's four lines per epoch; then, where they apply, the peak GPU memory, the rank
    that held the others back, and fp16's skipped steps."""
    log(f"Epoch {metrics['epoch']}/{epochs} completed in {metrics['epoch_time_s']:.3f} seconds")
    log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
    log(f"Epoch Throughput: {metrics['images_per_s']:.3f} images/second")
    log(f"Train Loss: {metrics['train_loss']:.4f}, Validation Top-5 Accuracy: {metrics['val_top5']:.4f}")
    if "test_acc" in metrics:  # --val-size: the lines above score the validation split, this one the test set
        log(f"Test Loss: {metrics['test_loss']:.4f}, Test Accuracy: {metrics['test_acc']:.4f}, Test Top-5 Accuracy: "
            f"{metrics['test_top5']:.4f}")
    if metrics.get("scored") == "model_ema":
        log("(scores of the weight EMA, --model-ema)")
    if "grad_norm" in metrics:
        skipped = metrics["nonfinite_grad_steps"]
        log(f"Gradient norm before clipping: {metrics['grad_norm']:.3f} (mean over the epoch's finite norms"
            f"{f'; {skipped} steps had a non-finite norm (fp16: the scaler skipped them)' if skipped else ''})")
    if "peak_memory_gib" in metrics:  # CUDA
        ranks = metrics["rank_times"]
        top = max(ranks, key=lambda r: r["peak_memory_gib"])
        log(f"Peak GPU memory: {top['peak_memory_gib']:.2f} GiB (rank {top['rank']} on {top['host']}; the least "
            f"{min(r['peak_memory_gib'] for r in ranks):.2f} GiB)")
    if metrics.get("slow_rank"):
        log(f"warning: one rank held the others back: {metrics['slow_rank']} (each rank's split: rank_times in "
            f"metrics.jsonl)")
    if metrics.get("nonfinite_samples"):
        log(f"warning: {metrics['nonfinite_samples']} samples had a non-finite fp16 loss; the scaler skipped their "
            f"steps")
