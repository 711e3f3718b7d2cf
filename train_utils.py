"""What train_ddp.py uses, in the order it uses it: the LR schedule, DDP's options and comm hook, the loss sums, the
unused-parameter check, the checks the ranks agree on (RunChecks: a stop request, a non-finite loss, unreadable
samples), where training stands (Progress), the checkpoint a run continues (find_checkpoint: every rank's torch.load)
and what a checkpoint holds (Checkpoint: rank 0's torch.save), and the original script's first lines. Below it,
machinery/ (machinery/README.md). One error protocol throughout: a problem the user can fix is a UserError
(exit 2; WriteError, exit 74), raised on every rank at once and said once by rank 0."""
from __future__ import annotations

import inspect
import json
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from config import RunConfig, get_args_parser
from machinery.checkpoints import check_room, is_best_epoch, load_latest_checkpoint, save_checkpoint
from machinery.errors import UserError, agree_on_error, all_gather, all_reduce_max, call_and_agree
from machinery.files import describe_position, try_write
from machinery.launch import DistEnv
from machinery.output import log
from machinery.signals import StopRequest

__all__ = [  # what this file defines for the recipe, in its order (the recipe imports machinery's names from there)
    "lr_factor", "NO_FORWARD_BUFFER_SYNC", "comm_hook", "step_stats", "LossCheck", "check_parameters_used",
    "RunChecks", "Progress", "Found", "find_checkpoint", "Checkpoint", "log_start"]


# ------------------------------------------------------------------------- the LR schedule

def lr_factor(start: float, end: float, *, epochs: int, warmup_epochs: float, schedule: str) -> float:
    """Multiplier of the peak LR for a step from `start` to `end`, in epochs done (counted in samples, not
    steps: a resume with another batch size keeps its place). Linear warm-up, then cosine to 0, the WRN
    paper's steps (x0.2 at 30%, 60% and 80% of training), or constant (the original script's)."""
    if start < warmup_epochs:
        return min(1.0, end / warmup_epochs)
    if schedule == "constant":
        return 1.0
    if schedule == "step":
        return 0.2 ** sum(start >= m * epochs - 1e-9 for m in (0.3, 0.6, 0.8))  # 1e-9: 0.8 * 7 is 5.6000000000000005
    progress = (start - warmup_epochs) / max(epochs - warmup_epochs, 1e-9)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# ------------------------------------------------------------- DDP's option, the loss sums

# DDP's option that turns off its broadcast of the buffers before every forward: forward_sync_buffers since
# torch 2.14 (broadcast_buffers, which older versions have, is deprecated there).
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})


def comm_hook(cfg, env: DistEnv) -> tuple:
    """--comm-hook as DDP.register_comm_hook takes it, (state, hook): torch's own hooks, fp16_compress_hook,
    bf16_compress_hook, or powerSGD_hook with its PowerSGDState (machinery/comm_hooks.py, loaded only then); (None,
    None) for none, DDP's built-in all-reduce."""
    if cfg.comm_hook == "none":
        return None, None
    from machinery.comm_hooks import torch_comm_hook
    return torch_comm_hook(cfg, env)


# The epoch's sums, one float64 tensor on the device (one all-reduce sums them all), slot by slot: the loss
# times the samples over finite losses, those samples, all samples; with --clip-grad-norm, the gradient norm
# over finite norms, those steps, all steps. Progress.sums holds them as a list, in checkpoints too.
EPOCH_SUMS = ("loss_sum", "finite_samples", "samples", "grad_norm_sum", "finite_norm_steps", "norm_steps",
              "correct")  # and the samples whose top prediction is their label (with mixup: its larger share)


def step_stats(loss_sum: torch.Tensor | None = None, n: int = 0, *, correct: torch.Tensor | None = None,
               grad_norm: torch.Tensor | None = None):
    """A share of the epoch's sums (EPOCH_SUMS): a micro-batch's summed loss over n samples and its `correct` count,
    or a step's gradient norm, counted on rank 0 alone (all ranks have it; the sums are all-reduced). Device tensors
    only: nothing waits for the GPU."""
    value = loss_sum if grad_norm is None else grad_norm
    finite = torch.isfinite(value).double()
    kept = torch.where(finite > 0, value.double(), 0.0)
    zero = torch.zeros(3, dtype=torch.float64, device=value.device)
    if grad_norm is None:
        hits = (correct if correct is not None else finite * 0).double().reshape(1)
        return torch.cat([torch.stack([kept, finite * n, finite * 0 + n]), zero, hits])
    counted = not dist.is_initialized() or dist.get_rank() == 0
    return torch.cat([zero, torch.stack([kept, finite, finite * 0 + 1]), zero[:1]]) * float(counted)


class LossCheck:
    """Whether the training loss went NaN or infinite on any rank, from the epoch's sums (EPOCH_SUMS): any such
    sample stops the run, or with fp16's grad scaler (`allow_nonfinite`), which skips the odd overflowing step, only
    divergence does: most samples non-finite since the previous check."""

    def __init__(self, device: torch.device, *, allow_nonfinite: bool):
        self.device, self.allow_nonfinite, self.previous = device, allow_nonfinite, None
        self.slots = [EPOCH_SUMS.index("finite_samples"), EPOCH_SUMS.index("samples")]

    def check(self, sums) -> None:
        """A collective (one small all-reduce): every rank raises UserError if the loss went non-finite on
        any. `sums`: the epoch's so far, a device tensor or a list."""
        counts = torch.as_tensor(sums, dtype=torch.float64).to(self.device)[self.slots]  # finite, all
        if self.allow_nonfinite:
            previous = self.previous if self.previous is not None else torch.zeros_like(counts)
            previous = torch.where(counts[1] >= previous[1], previous, 0.0)  # a new epoch restarted the sums
            self.previous = counts.clone()
            finite, count = counts - previous
            diverged = finite < 0.5 * count
        else:
            diverged = counts[0] < counts[1]
        if not all_reduce_max(diverged.double()).item():
            return
        if self.allow_nonfinite:
            raise UserError("the training loss was NaN or infinite in most fp16 steps since the last check: "
                            "training diverged, and stopped before saving; lower --base-lr, raise "
                            "--warmup-epochs or use --amp bf16, then run again to resume from the last "
                            "checkpoint")
        raise UserError("the training loss became NaN or infinite, so training stopped before saving "
                        "anything from it (the last checkpoint is intact): lower --base-lr or raise "
                        "--warmup-epochs")


def check_parameters_used(model) -> None:
    """A collective, after a step's backward under DDP (without find_unused_parameters): UserError on every rank,
    naming them, if parameters got no gradient (an auxiliary head, a branch not taken); DDP would fail at the next
    forward instead ("Expected to have finished reduction in the prior iteration"), in a traceback per rank."""
    ddp = getattr(model, "_orig_mod", model)
    if not isinstance(ddp, DDP) or ddp.find_unused_parameters:
        return
    mine = [name for name, p in ddp.module.named_parameters() if p.requires_grad and p.grad is None]
    unused = list(dict.fromkeys(name for names in all_gather(mine) for name in names))  # every rank's, in order
    if unused:
        params = dict(ddp.module.named_parameters())
        values = sum(params[name].numel() for name in unused)
        shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise UserError(f"the model's parameters {shown} ({len(unused)} tensors, {values:,} values) got "
                        f"no gradient: DDP needs every parameter in the loss of every step; use them in the "
                        f"loss or remove them from the model, or pass --find-unused-parameters (DDP then "
                        f"searches the autograd graph after every forward for them, which costs time in "
                        f"every step)")


class RunChecks(StopRequest):
    """What ends a run, agreed by every rank at once: a stop request (StopRequest's: a signal or the stop file,
    caught while `with` holds), a non-finite loss (LossCheck), samples that do not read (the loader's check)."""

    def __init__(self, loader, device, *, allow_nonfinite: bool):
        super().__init__()
        self.loader, self.device = loader, device
        self.loss = LossCheck(device, allow_nonfinite=allow_nonfinite)  # fp16's scaler skips the odd bad step

    def check(self, sums) -> bool:
        """Collectives: every rank calls it at the same steps. Unreadable samples named and skipped, or every rank
        raises (before any checkpoint holds them); a NaN loss on any rank ends every rank (before it reaches a
        checkpoint); True on every rank if any was asked to stop. `sums`: the epoch's so far (EPOCH_SUMS)."""
        self.loader.check()
        self.loss.check(sums)
        return super().check(self.device)


# ------------------------------------------------------------------------- where training stands

@dataclass
class Progress:
    """Where training stands. Saved in every checkpoint, so a run resumes mid-epoch exactly."""
    epoch: int = 0              # epochs completed
    position: int = 0           # samples of epoch + 1's order trained so far (global, all ranks)
    step: int = 0               # steps taken in epoch + 1 (for the progress lines and --checkpoint-every)
    sums: list = field(default_factory=lambda: [0.0] * len(EPOCH_SUMS))  # that epoch so far (step_stats)
    elapsed_s: float = 0.0      # that epoch's training time so far
    history: list = field(default_factory=list)  # one metrics dict per completed epoch
    total_time_s: float = 0.0
    total_images: int = 0
    stopped_early: bool = False
    skipped: list = field(default_factory=list)  # that epoch's unreadable samples skipped so far

    def finish_epoch(self, epoch: int, val: dict, *, lr: float, cfg, timing: dict, eval_s: float = 0.0) -> dict:
        """Close a trained and evaluated epoch: its row of metrics.jsonl (the all-reduced training sums, the
        test metrics `val`, the last step's LR, its time, the evaluation's `eval_s`, the run's training and
        training-plus-evaluation seconds so far, resumes included, and `timing`: StepLog.finish_epoch's every
        rank's split), kept in the history. Returns the row."""
        sums = dict(zip(EPOCH_SUMS, self.sums))
        count = sums["samples"]
        # The run's seconds so far, resumes included (a checkpoint from before these fields: its epochs' times).
        before = self.history[-1] if self.history else {}
        train_s = before.get("train_time_s", sum(m["epoch_time_s"] for m in self.history)) + self.elapsed_s
        run_s = before.get("run_time_s", train_s - self.elapsed_s) + self.elapsed_s + eval_s
        metrics = {"epoch": epoch, "train_loss": sums["loss_sum"] / max(sums["finite_samples"], 1),
                   "train_acc": sums["correct"] / max(count, 1), "train_samples": int(count), **val, "lr": lr,
                   "epoch_time_s": self.elapsed_s, "images_per_s": count / self.elapsed_s, "eval_time_s": eval_s,
                   # the time to an accuracy: the first row that reaches it (summary.json: --target-accuracy's)
                   "train_time_s": train_s, "run_time_s": run_s}
        if sums["finite_samples"] < count:  # fp16: samples whose loss was not finite, in steps the scaler skipped
            metrics["nonfinite_samples"] = int(count - sums["finite_samples"])
        # --clip-grad-norm: the mean norm before clipping, and the steps with a non-finite one
        if sums["norm_steps"]:
            metrics["grad_norm"] = sums["grad_norm_sum"] / max(sums["finite_norm_steps"], 1)
            metrics["nonfinite_grad_steps"] = int(sums["norm_steps"] - sums["finite_norm_steps"])
        if cfg.model_ema:
            metrics["scored"] = "model_ema"  # the test (and validation) metrics are the weight EMA's
        metrics["skipped_samples"] = len(self.skipped)  # unreadable, skipped (--skip-bad-samples), named in the log
        metrics.update(timing)
        self.history.append(metrics)
        self.epoch, self.position, self.step = epoch, 0, 0
        self.total_time_s += self.elapsed_s
        self.total_images += int(count)
        self.sums, self.elapsed_s, self.skipped = [0.0] * len(EPOCH_SUMS), 0.0, []
        return metrics


# ------------------------------------------------------------------------- what a checkpoint holds

@dataclass
class Found:
    """The checkpoint a run continues (or --evaluate scores), or none: a new run."""
    ckpt: dict | None = None
    path: str | None = None
    flags: dict = field(default_factory=dict)  # the flags to run with: as given, or as the checkpoint rules
    notes: list = field(default_factory=list)  # what this run changes, for the start of the log
    finished: str | None = None  # a finished run rerun with the same command: the line that says so
    kept: set = field(default_factory=set)  # flags the checkpoint set, not the user (the per-rank memory cap)

    def describe_model(self) -> str:
        from machinery.resume import describe_model
        return describe_model(self.ckpt["model_config"])


def find_checkpoint(args, explicit: set, env: DistEnv, *, rules: dict) -> Found:
    """The checkpoint this run continues, the newest in --out-dir that loads (torch.load, weights_only), and the
    flags to continue it with. Every rank raises the UserError that says why it cannot: an older format, a flag
    that `rules` (config.RESUME_RULES) refuses to change, another device type, a finished run asked to change.
    Its data and model are checked once built (load_checked_data, Checkpoint.restore)."""
    def load(path):  # every rank reads it; weights_only: tensors and plain data, never pickled code
        return torch.load(path, map_location=env.device, weights_only=True)
    loaded = call_and_agree(load_latest_checkpoint, args.out_dir, load, args.keep_checkpoints)  # newest that loads
    ckpt, path = loaded or (None, None)
    if ckpt is None:
        if args.evaluate:
            raise UserError(f"--evaluate needs a checkpoint, and there is none in {args.out_dir}")
        return Found(flags=dict(vars(args)))  # a new run, with the flags as given
    from machinery import resume  # what a resume checks, loaded when there is one
    resume.check_format(ckpt, path)
    flags, notes = call_and_agree(resume.checkpoint_flags, args, explicit, ckpt, rules)
    call_and_agree(resume.check_same_device, ckpt, path, env.device, args.evaluate)
    finished = None if args.evaluate else call_and_agree(resume.check_finished, ckpt, path, flags, notes)
    if finished:  # a finished run rerun with the same command (a requeue, say): said now, nothing to train
        log(finished)
    kept = {"micro_batch"} if not args.evaluate and flags["micro_batch"] != args.micro_batch else set()
    return Found(ckpt, path, flags, notes, finished, kept)


class Checkpoint:
    """What a checkpoint holds, registered once; saving, restoring and sizing go over it. `state` (name=object
    with state_dict() and load_state_dict()) is required. State an option adds later goes in `optional` (name:
    (object, what stands in for it in an older checkpoint); or add()): old checkpoints still resume, nothing
    guessed silently.
    Besides the state: where training stands (Progress), the config, the model's config, the data's
    fingerprints, and every rank's RNG states (machinery/checkpoints.py: REQUIRED_KEYS)."""

    def __init__(self, cfg: RunConfig, env: DistEnv, data, *, model_config: dict, lock=None, optional=None,
                 **state):
        self.cfg, self.env, self.data, self.model_config, self.lock = cfg, env, data, model_config, lock
        self.required = state     # name -> object
        self.optional = {}        # name -> (object, what stands in when absent, a function that sets it)
        for name, (obj, when_absent) in (optional or {}).items():  # name -> (object or None, when_absent)
            self.add(name, obj, when_absent=when_absent)

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
        from --init-from's weights if given (the model's only: the rest starts afresh). A run that trains then
        checks the out-dir's room for its next checkpoint (check_room): a full disk is refused now, not after
        an epoch's work."""
        if not self.cfg.evaluate:
            self.check_room()
        if found.ckpt is None:
            if self.cfg.init_from and not self.cfg.evaluate:
                from machinery.init_weights import load_initial_weights
                log(call_and_agree(load_initial_weights, self.required["model"], self.cfg.init_from))
            return Progress()
        from machinery.resume import check_format, check_same_model, note_resume_changes
        ckpt, cfg, env = found.ckpt, self.cfg, self.env
        check_format(ckpt, found.path, required=self.required)  # all it must hold, or one line
        check_same_model(found, self.model_config)  # the model this run builds, or one line
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
        progress.sums += [0.0] * (len(EPOCH_SUMS) - len(progress.sums))  # a checkpoint from before the gradient norm
        if not cfg.evaluate:
            note_resume_changes(saved, cfg, progress, draws=self.data.draws)
        progress.step = -(-progress.position // cfg.batch_size)
        if ckpt["world_size"] == env.world_size:  # else the seeding at build time serves as well as any
            torch.set_rng_state(ckpt["rng_cpu"][env.rank].cpu())
            if env.cuda and ckpt["rng_cuda"]:
                torch.cuda.set_rng_state(ckpt["rng_cuda"][env.rank].cpu(), env.device)
        if not cfg.evaluate:
            rest = (f", and {progress.position} samples ({progress.step} steps) of the next"
                    if progress.position else "")
            log(f"Resumed from {found.path}: epoch {progress.epoch} of {cfg.epochs} done{rest}.")
        return progress

    def check_room(self) -> None:
        """Refuse to start when the out-dir has no room for the next checkpoint, sized by what it will hold
        (an optimizer's state included before its first step), and best.pt beside it with --val-size. Rank 0
        checks; every rank raises."""
        copies = 2 if self.cfg.val_size else 1
        call_and_agree(check_room, self.cfg.out_dir, self.objects(), copies=copies, here=self.env.is_main)

    def save(self, progress: Progress) -> None:
        """Write a checkpoint. Every rank calls this (it gathers their RNG states); rank 0 writes, unless
        another run took the out-dir, and all ranks leave together if that write fails."""
        rng_cpu = all_gather(torch.get_rng_state())
        rng_cuda = all_gather(torch.cuda.get_rng_state(self.env.device)) if self.env.cuda else []
        state = {**{name: obj.state_dict() for name, obj in self.objects().items()},
                 "progress": asdict(progress),
                 "config": {**self.cfg.to_dict(), "data_spec": asdict(self.data.spec), "draws": self.data.draws},
                 "model_config": self.model_config, "data": self.data.fingerprints,
                 "world_size": len(rng_cpu), "rng_cpu": rng_cpu, "rng_cuda": rng_cuda}
        out_dir, what = self.cfg.out_dir, f"the checkpoint {describe_position(**asdict(progress))}"
        # --val-size: an epoch's end with the best validation accuracy so far is also best.pt
        best = bool(self.cfg.val_size) and not progress.position and is_best_epoch(progress.history)
        error = None
        if self.env.is_main:  # every rank holds the same weights: rank 0 alone writes them
            def write(f):  # into a temporary file, renamed over checkpoint.pt once whole (older ones shifted down)
                torch.save(state, f)
            error = try_write(lambda: save_checkpoint(out_dir, write, self.cfg.keep_checkpoints, best=best),
                              what=what, out_dir=out_dir, lock=self.lock)
        agree_on_error(error)  # every rank learns whether it worked: if not, all leave together, in one line


# ------------------------------------------------------------------------- the original script's lines

def log_start(cfg: RunConfig, env: DistEnv, data, found: Found) -> None:
    """The original script's first two lines, then the flags that differ from their defaults (config.py's),
    the batch split and the LR, the data, and notes on what a resumed run changes."""
    parser = get_args_parser()
    unit = "GPUs" if env.cuda else "CPU processes"
    log(f"Training started with {env.world_size} processes across {cfg.nodes} nodes.")
    log(f"Using {env.local_world_size} {unit} per node.")
    changed = {k: v for k, v in cfg.flags.items() if parser.get_default(k) != v and k not in found.kept}
    kept = "".join(f", and the checkpoint's --{k.replace('_', '-')} {cfg.flags[k]}"
                   for k in sorted(found.kept))
    log(f"Config: {json.dumps(changed)} (the rest: the defaults{kept}; all of it in "
        f"{cfg.out_dir}/config.json)")
    split = (f"{env.world_size} ranks x {cfg.accumulation_steps} accumulation steps x {cfg.micro_batch_size}"
             if cfg.accumulation_steps > 1 else f"{env.world_size} ranks x {cfg.per_rank_batch}")
    rule = ("--base-lr as given, --lr-scaling none" if cfg.lr_scaling == "none" else
            f"{cfg.lr_scaling} scaling of {cfg.base_lr:g} from batch {cfg.reference_batch_size}")
    log(f"Global batch {cfg.batch_size} = {split}; LR {cfg.lr:.4g} ({rule}; {cfg.lr_schedule} after "
        f"{cfg.warmup_epochs:g} warm-up epochs)")
    spec = data.spec
    sizes = data.sizes or f"{spec.channels} x {spec.height} x {spec.width}"  # a range where a Dataset's differ
    log(f"Data: {data.source}: {len(data.train)} training and {len(data.test)} test images of "
        f"{sizes}, {spec.num_classes} classes; per-channel mean "
        f"{tuple(round(m, 4) for m in spec.mean)}, std {tuple(round(s, 4) for s in spec.std)}")
    if cfg.patience:
        log(describe_early_stopping(cfg))
    notes = [*found.notes, *flag_notes(cfg, found.ckpt)]
    if cfg.comm_hook != "none":  # what compressing the all-reduce changes
        from machinery.comm_hooks import comm_hook_notes
        notes += comm_hook_notes(cfg, found.ckpt, steps=cfg.epochs * math.ceil(len(data.train) / cfg.batch_size))
    for note in notes:
        log(f"note: {note}")


def describe_early_stopping(cfg) -> str:
    """The line that says early stopping is on: the rule, the split that decides, and the way to turn it off."""
    split = (f"the validation split (--val-size {cfg.val_size})" if cfg.val_size else
             "the test set (no --val-size: the test set then picks the epoch, and its score is no longer "
             "an unbiased estimate; --val-size N decides on N held-out training samples)")
    return (f"Early stopping is on: the run ends once {cfg.patience} epoch{'s' if cfg.patience > 1 else ''} in "
            f"a row reach accuracy {cfg.target_accuracy:g} on {split}; --patience 0 trains all "
            f"{cfg.epochs} epochs")


def flag_notes(cfg, ckpt: dict | None = None) -> list:
    """What the flags do that a user probably did not mean, each in a line: the LR rule training far below
    --base-lr for a small batch, a warm-up that takes most of a short run, and a resume with another --epochs
    that sends the schedule's LR back up (`ckpt`: the checkpoint resumed, if any)."""
    notes = []
    if ckpt is not None and ckpt["config"]["epochs"] != cfg.epochs and cfg.lr_schedule != "constant":
        at, before = ckpt["progress"]["epoch"], ckpt["config"]["epochs"]  # epochs done, the run's length so far

        def lr(epochs):
            return cfg.lr * lr_factor(at, at, epochs=epochs, warmup_epochs=cfg.warmup_epochs,
                                      schedule=cfg.lr_schedule)
        if lr(cfg.epochs) > 1.5 * lr(before):
            notes.append(f"--epochs {before} -> {cfg.epochs} stretches the {cfg.lr_schedule} schedule: after "
                         f"epoch {at} the LR goes back up from {lr(before):.4g} to {lr(cfg.epochs):.4g}; to "
                         f"fine-tune at a low LR instead, start a new run from these weights (--init-from) "
                         f"with its own schedule")
    if cfg.lr_scaling != "none" and cfg.lr <= cfg.base_lr / 4:
        notes.append(f"--batch-size {cfg.batch_size} is far below --reference-batch-size "
                     f"{cfg.reference_batch_size}, so {cfg.lr_scaling} scaling trains at LR {cfg.lr:.4g}, "
                     f"{cfg.base_lr / cfg.lr:.3g}x below --base-lr {cfg.base_lr:g}; to train at --base-lr as "
                     f"given, add --lr-scaling none (or --reference-batch-size {cfg.batch_size})")
    if cfg.lr_scaling != "none" and cfg.lr > cfg.base_lr * 4:
        notes.append(f"--batch-size {cfg.batch_size} is far above --reference-batch-size "
                     f"{cfg.reference_batch_size}, so {cfg.lr_scaling} scaling trains at LR {cfg.lr:.4g}, "
                     f"{cfg.lr / cfg.base_lr:.3g}x above --base-lr {cfg.base_lr:g}; if the loss diverges, "
                     f"lengthen the warm-up (--warmup-epochs {cfg.warmup_epochs:g} now) or use "
                     f"--lr-scaling sqrt")
    if cfg.compile_mode != "default" and not cfg.compile:
        notes.append(f"--compile-mode {cfg.compile_mode} does nothing without --compile: add --compile")
    if cfg.warmup_epochs and cfg.warmup_epochs >= cfg.epochs / 2:
        notes.append(f"{cfg.warmup_epochs:g} of the {cfg.epochs} epochs warm up (--warmup-epochs "
                     f"{cfg.warmup_epochs:g}): the LR peaks only at epoch "
                     f"{min(cfg.warmup_epochs, cfg.epochs):g}; for a short run, lower --warmup-epochs")
    return notes
