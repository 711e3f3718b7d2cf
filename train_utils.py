"""What train_ddp.py uses, in its order: the flags (a flag added to get_args_parser is cfg.<its name>), presets and
resume rules, the argument checks, the config computed once (make_config), the LR schedule, DDP's options, the loss
sums, the checks the ranks agree on, where training stands, the checkpoint (find_checkpoint's torch.load,
Checkpoint's torch.save), the first lines. A problem the user can fix is a UserError, said once, on every rank."""
from __future__ import annotations

import argparse
import inspect
import json
import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from machinery.checkpoints import (ANY, DATA, MODEL, NOTED, QUIET, RECIPE, check_room, is_best_epoch,
                                   load_latest_checkpoint, save_checkpoint)
from machinery.errors import UserError, all_gather, all_reduce_max, call_and_agree
from machinery.files import describe_position, write_on_main
from machinery.launch import DistEnv, default_workers
from machinery.output import log
from machinery.signals import StopRequest

__all__ = [  # what this file defines for the recipe, in its order (the recipe imports machinery's names from there)
    "RECIPES", "get_args_parser", "RESUME_RULES", "check_args", "RunConfig", "make_config",
    "lr_factor", "NO_FORWARD_BUFFER_SYNC", "step_stats", "LossCheck", "check_parameters_used",
    "RunChecks", "Progress", "Found", "find_checkpoint", "Checkpoint", "log_start"]


# The WRN paper's CIFAR-100 recipe (Zagoruyko & Komodakis 2016: WRN-16-8, 79.6% top-1; x0.2 at 60/120/160), at batch
# 512 by the linear rule with 5 warm-up epochs; the whole schedule, always: no early stopping (--patience 0).
WRN_PAPER = dict(depth=16, widen_factor=8, dropout=0.0, epochs=200, batch_size=512, base_lr=0.1,
                 reference_batch_size=128, lr_scaling="linear", warmup_epochs=5.0, lr_schedule="step",
                 momentum=0.9, nesterov=True, weight_decay=5e-4, patience=0)

COMPILE_MODES = ["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"]  # torch.compile's
# DDP's communication hooks, torch's own (none: DDP's all-reduce of fp32 gradients; docs/comm-hooks.md)
COMM_HOOKS = ["none", "fp16", "bf16", "powersgd"]


RECIPES = {
    "wrn-paper": WRN_PAPER,  # the job scripts' recipe
    # wrn-paper + the mirror at evaluation (--tta), the measured pick: not measurably better (bench-results/README.md)
    "modern": dict(**WRN_PAPER, tta=True),
    # The original script's LR: --base-lr as given for any batch, constant, no warm-up (docs/original-script.md)
    "original": dict(lr_scaling="none", warmup_epochs=0.0, lr_schedule="constant"),
    # About 70 s on 2 idle CPU cores: a WRN-10-2 on the learnable synthetic data, no download (13% -> 89% top-1).
    "cpu-try": dict(dataset="synthetic", depth=10, widen_factor=2, train_size=5000, test_size=1000,
                    batch_size=128, base_lr=0.1, reference_batch_size=128, epochs=3, patience=0,
                    out_dir="runs/cpu-try"),
}


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="CIFAR-100 DDP example with Mixed Precision",
                                epilog="The defaults are the original script's 5-epoch smoke run.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False)  # --epoch is a typo to name, not --epochs to guess
    g = p.add_argument_group("the original script's flags")  # their meaning kept
    g.add_argument("--batch-size", type=int, default=512, help="global batch size, split evenly over all ranks")
    g.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
    g.add_argument("--base-lr", type=float, default=0.01, help="LR for a global batch of --reference-batch-size")
    g.add_argument("--target-accuracy", type=float, default=0.85,
                   help="validation accuracy (fraction) for early stopping")
    g.add_argument("--patience", type=int, default=2,
                   help="stop after this many epochs in a row at or above the target (0: no early stopping)")
    g = p.add_argument_group("model")
    g.add_argument("--depth", type=int, default=16, help="WideResNet depth, 6n+4")
    g.add_argument("--widen-factor", type=int, default=8, help="WideResNet width multiplier k")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout between the convs of each block")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100",
                   help="synthetic: learnable, no download")
    g.add_argument("--data-dir", default="./datasets", help="where cifar-100-python.tar.gz is, or is downloaded to")
    g.add_argument("--train-size", type=int, default=0,
                   help="use only N training samples (0: all): the first N, or an image folder's N spread over it")
    g.add_argument("--test-size", type=int, default=0,
                   help="use only N test samples (0: all): the first N, or an image folder's N spread over it")
    g.add_argument("--loader", choices=["auto", "gpu", "torch"], default="auto",
                   help="gpu: data kept on the device (the CPU without CUDA); torch: DataLoader workers; "
                   "auto: gpu on CUDA, else torch")
    g.add_argument("--workers", type=int, default=-1,
                   help="DataLoader workers per rank (-1: its share of the CPUs, at most 8)")
    g.add_argument("--skip-bad-samples", type=int, default=0,
                   help="skip up to N unreadable training samples per epoch (0: stop)")
    g = p.add_argument_group("optimisation and schedule")
    g.add_argument("--micro-batch", type=int, default=None,
                   help="most samples per forward on a rank, more by accumulation")
    g.add_argument("--reference-batch-size", type=int, default=512, help="the global batch --base-lr was tuned for")
    g.add_argument("--lr-scaling", choices=["linear", "sqrt", "none"], default="linear",
                   help="LR rule for the batch's ratio")
    g.add_argument("--lr-schedule", choices=["cosine", "step", "constant"], default="cosine",
                   help="after warm-up: cosine to 0, x0.2 steps at 30/60/80%%, or constant")
    g.add_argument("--warmup-epochs", type=float, default=1.0, help="linear LR warm-up from ~0, in epochs")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=False, help="Nesterov momentum")
    g.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    g.add_argument("--label-smoothing", type=float, default=0.0, help="label smoothing of the training loss")
    g.add_argument("--sync-bn", action="store_true",
                   help="BatchNorm statistics over all ranks (SyncBatchNorm; CUDA only)")
    g.add_argument("--find-unused-parameters", action="store_true",
                   help="let the loss leave parameters out (DDP: cost per step)")
    g.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP's gradient bucket size in MiB: each bucket is all-reduced once its gradients are in")
    g.add_argument("--comm-hook", choices=COMM_HOOKS, default="none",
                   help="DDP communication hook: fp16/bf16 send half the bytes, powersgd a low-rank approximation")
    g.add_argument("--powersgd-rank", type=int, default=1,
                   help="--comm-hook powersgd: the approximation's rank (higher: closer, more bytes)")
    g.add_argument("--powersgd-start", type=int, default=1000,
                   help="--comm-hook powersgd: optimizer steps of plain all-reduce first (at least 2)")
    g = p.add_argument_group("the modern recipe (each off by default, as in the original script)")
    g.add_argument("--model-ema", action="store_true",
                   help="evaluate and save an EMA of the weights and BatchNorm buffers")
    g.add_argument("--model-ema-decay", type=float, default=0.999,
                   help="the EMA's decay per --reference-batch-size samples")
    g.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip the gradients' global norm to N (fp16: unscaled)")
    g.add_argument("--auto-augment", choices=["ta_wide"], default=None,
                   help="TrivialAugmentWide on each training image")
    g.add_argument("--random-erase", type=float, default=0.0,
                   help="probability of erasing a random box of a training image")
    g.add_argument("--mixup-alpha", type=float, default=0.0,
                   help="mixup in each micro-batch: ratio ~ Beta(alpha, alpha)")
    g.add_argument("--cutmix-alpha", type=float, default=0.0,
                   help="cutmix in each micro-batch (with mixup: one of them, 50/50)")
    g.add_argument("--norm-weight-decay", type=float, default=None,
                   help="weight decay of biases and norm layers (else: --weight-decay)")
    g.add_argument("--tta", action=argparse.BooleanOptionalAction, default=False,
                   help="evaluation averages the logits of each image and its mirror")
    g.add_argument("--val-size", type=int, default=0,
                   help="hold N training samples out to validate on (best.pt follows it)")
    g.add_argument("--init-from", default=None,
                   help="start from a checkpoint's or state_dict's weights (another head: fresh)")
    g = p.add_argument_group("the run")
    g.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="a named preset (below); flags given win over it")
    g.add_argument("--out-dir", default="./runs/wrn",
                   help="checkpoints, metrics and summary; a checkpoint here is resumed")
    g.add_argument("--seed", type=int, default=0, help="seed for the weights, the data order and augmentation")
    g.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA if available, else CPU")
    g.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto",
                   help="mixed precision; auto: bf16 on GPUs")
    g.add_argument("--timeout", type=float, default=600, help="seconds before a hung collective or rendezvous fails")
    g.add_argument("--log-every", type=int, default=50, help="a progress line every N steps (0: none)")
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="also checkpoint every N steps (0: at epoch ends only)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="how many recent checkpoints to keep")
    g.add_argument("--stop-after-epoch", type=int, default=0,
                   help="end this run after that epoch, to resume later (0: never)")
    g.add_argument("--evaluate", action="store_true",
                   help="score the checkpoint in --out-dir on its test set, and exit")
    g.add_argument("--self-check", action="store_true",
                   help="run this copy's ADAPT places through the README's guarantees in short CPU runs, and exit")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (slower start, faster steps)")
    g.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile's mode with --compile (reduce-overhead: CUDA graphs)")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic cuDNN and cuBLAS kernels, cudnn.benchmark off: repeatable GPU runs, slower")
    g.add_argument("--tensorboard", action="store_true", help="also log the epoch metrics to out-dir/tensorboard")
    g.add_argument("--profile", action="store_true",
                   help="trace steps 4-8 of the first epoch on each rank into out-dir/profile")
    return p


# What a resume does with each flag (machinery/resume.py's checkpoint_flags). Changed, a DATA, MODEL or RECIPE flag
# is refused (other data, another model, another recipe); a NOTED one is said in the log; a QUIET one is not.
# (RULE, before): what a checkpoint written before the flag meant (None: off; ANY: any value continues it).
# A flag added to get_args_parser needs its line here (a unit test checks).
RESUME_RULES = {
    "batch_size": NOTED, "epochs": NOTED, "base_lr": NOTED, "target_accuracy": NOTED, "patience": NOTED,
    "depth": MODEL, "widen_factor": MODEL, "dropout": NOTED,
    "dataset": DATA, "data_dir": QUIET, "train_size": DATA, "test_size": DATA, "loader": QUIET, "workers": QUIET,
    "skip_bad_samples": QUIET,
    "micro_batch": NOTED, "reference_batch_size": NOTED, "lr_scaling": NOTED, "lr_schedule": NOTED,
    "warmup_epochs": NOTED, "momentum": NOTED, "nesterov": NOTED, "weight_decay": NOTED,
    "label_smoothing": NOTED, "sync_bn": NOTED, "find_unused_parameters": QUIET,
    # what crosses the network: the buckets only group the all-reduce; a hook rounds (fp16, bf16) or approximates
    # (powersgd) the gradients, so a change is noted; PowerSGD restarts on every resume (machinery/comm_hooks.py)
    "bucket_cap_mb": QUIET, "comm_hook": (NOTED, "none"), "powersgd_rank": (NOTED, ANY),
    "powersgd_start": (NOTED, ANY),
    "model_ema": RECIPE, "model_ema_decay": (RECIPE, ANY), "clip_grad_norm": RECIPE, "auto_augment": RECIPE,
    "random_erase": RECIPE, "mixup_alpha": RECIPE, "cutmix_alpha": RECIPE, "norm_weight_decay": RECIPE,
    "tta": QUIET, "val_size": (DATA, 0), "init_from": QUIET,
    "recipe": NOTED, "out_dir": QUIET, "seed": DATA, "device": QUIET, "amp": QUIET, "timeout": QUIET,
    "log_every": QUIET, "checkpoint_every": QUIET, "keep_checkpoints": QUIET, "stop_after_epoch": QUIET,
    "evaluate": QUIET, "self_check": QUIET, "compile": QUIET, "compile_mode": QUIET, "tensorboard": QUIET,
    "profile": QUIET,
    "deterministic": (NOTED, False),  # the kernels change, not the recipe: a resume may turn it on or off
}


# Each flag's range, checked by check_args: (flags, the test a value passes, what it must be, a hint).
ARG_RULES = [
    (("depth",), lambda v: v >= 10 and (v - 4) % 6 == 0, "must be 6n+4 with n >= 1 (10, 16, 22, 28, 40, ...)", ""),
    (("epochs", "widen_factor", "reference_batch_size", "keep_checkpoints", "powersgd_rank"), lambda v: v >= 1,
     "must be at least 1", ""),
    (("train_size", "test_size", "warmup_epochs", "weight_decay", "stop_after_epoch", "checkpoint_every",
      "skip_bad_samples", "norm_weight_decay", "mixup_alpha", "cutmix_alpha", "val_size"), lambda v: v >= 0,
     "must not be negative", ""),
    (("target_accuracy",), lambda v: 0 <= v <= 1, "is a fraction in [0, 1]",
     " (85% is 0.85; to train every epoch, turn early stopping off with --patience 0)"),
    (("random_erase",), lambda v: 0 <= v <= 1, "is a probability in [0, 1]", ""),
    (("dropout", "label_smoothing"), lambda v: 0 <= v < 1, "must lie in [0, 1)", ""),
    (("base_lr", "bucket_cap_mb", "clip_grad_norm"), lambda v: v > 0, "must be positive", ""),
    (("patience",), lambda v: v >= 0, "is a number of epochs in a row at the target",
     " (0: no early stopping, every epoch trained)"),
    (("micro_batch",), lambda v: v >= 1, "is the most samples per forward on one rank, at least 1",
     " (leave it out for no cap)"),
    (("model_ema_decay",), lambda v: 0 < v < 1, "is the average's decay per reference batch, in (0, 1)", ""),
    (("powersgd_start",), lambda v: v >= 2, "must be at least 2", " (DDP rebuilds its buckets after step 1)"),
]


def check_args(args, world_size: int, device: torch.device) -> None:
    """Reject bad input before any work, with one line that says what to change."""
    if args.batch_size < 1 or (args.batch_size % world_size and not args.evaluate):
        raise UserError(f"--batch-size {args.batch_size} must be a positive multiple of the world size "
                        f"{world_size}; try --batch-size "
                        f"{max(1, round(args.batch_size / world_size)) * world_size}")
    for names, test, must, hint in ARG_RULES:
        for name in names:
            value = getattr(args, name, None)  # None: unset, or a flag an adaptation dropped
            if value is not None and not test(value):
                raise UserError(f"--{name.replace('_', '-')} {must}, got {value}{hint}")
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs (torch's SyncBatchNorm runs only there); leave it out on CPU")
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard "
                            "(or pip install -e '.[tensorboard]')") from None


@dataclass(frozen=True, eq=False)
class RunConfig:
    """Every flag (cfg.epochs reads flags["epochs"]) and what this run's world makes of them, built once."""
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
        derived = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "flags"}
        amp = str(self.amp_dtype).removeprefix("torch.") if self.amp_dtype else None  # "bfloat16", or null
        return {**self.flags, **derived, "amp_dtype": amp}


def make_config(args, env: DistEnv, found=None) -> RunConfig:
    """The run's config from the flags (`found`'s where its checkpoint rules them) and `env`."""
    args = argparse.Namespace(**found.flags) if found is not None and found.flags else args
    clash = set(vars(args)) & ({f.name for f in fields(RunConfig)} | {"to_dict"})
    if clash:  # a flag named like a derived value would be shadowed by it
        raise ValueError(f"flags named like RunConfig's fields: {sorted(clash)}; "
                         f"rename them in get_args_parser")
    per_rank_batch = -(-args.batch_size // env.world_size)  # --batch-size is global: each rank takes its share
    accum = accumulation_steps(per_rank_batch, args.micro_batch)
    return RunConfig(
        flags=dict(vars(args)), world_size=env.world_size, nodes=env.nodes,
        per_rank_batch=per_rank_batch, accumulation_steps=accum, micro_batch_size=per_rank_batch // accum,
        eval_batch=min(per_rank_batch, args.micro_batch or per_rank_batch),
        lr=scaled_lr(args.base_lr, args.batch_size, args.reference_batch_size, args.lr_scaling),
        num_workers=args.workers if args.workers >= 0 else default_workers(env), device_type=env.device.type,
        amp_dtype={"fp16": torch.float16, "bf16": torch.bfloat16, "off": None, "auto": auto_amp(env.device)}[args.amp],
        # One horizon in samples at any batch: a step of B samples decays by D^(B / reference batch) (as torchvision).
        ema_decay=args.model_ema_decay ** (args.batch_size / args.reference_batch_size))


def accumulation_steps(per_rank_batch: int, micro_batch) -> int:
    """The fewest micro-steps that split a rank's batch into equal micro-batches of at most `micro_batch`."""
    if not micro_batch or micro_batch >= per_rank_batch:
        return 1
    return next(a for a in range(1, per_rank_batch + 1)
                if per_rank_batch % a == 0 and per_rank_batch // a <= micro_batch)


def scaled_lr(base_lr: float, batch_size: int, reference_batch: int, rule: str) -> float:
    """Scale the LR tuned for `reference_batch` to the global batch (Goyal et al. 2017 for linear)."""
    ratio = batch_size / reference_batch
    return base_lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def auto_amp(device: torch.device):
    """--amp auto: bf16 from Ampere (8.0; is_bf16_supported() says yes if emulated), fp16 before; CPU: fp32."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def lr_factor(start: float, end: float, *, epochs: int, warmup_epochs: float, schedule: str) -> float:
    """Multiplier of the peak LR for a step from `start` to `end` epochs done (in samples: a resume with another
    batch size keeps its place). Linear warm-up, then cosine to 0, x0.2 at 30/60/80% of training, or constant."""
    if start < warmup_epochs:
        return min(1.0, end / warmup_epochs)
    if schedule == "constant":
        return 1.0
    if schedule == "step":
        return 0.2 ** sum(start >= m * epochs - 1e-9 for m in (0.3, 0.6, 0.8))  # 1e-9: 0.8 * 7 is 5.6000000000000005
    progress = (start - warmup_epochs) / max(epochs - warmup_epochs, 1e-9)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# DDP's broadcast of the buffers before each forward, off: forward_sync_buffers since torch 2.14 (broadcast_buffers
# before, deprecated there).
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})


# The epoch's sums, one float64 device tensor (one all-reduce sums them all): the loss over finite losses, their
# samples, all samples; with --clip-grad-norm, the gradient norm over finite norms, those steps, all steps.
EPOCH_SUMS = ("loss_sum", "finite_samples", "samples", "grad_norm_sum", "finite_norm_steps", "norm_steps",
              "correct")  # and the samples whose top prediction is their label (with mixup: its larger share)


def step_stats(loss_sum: torch.Tensor | None = None, n: int = 0, *, correct: torch.Tensor | None = None,
               grad_norm: torch.Tensor | None = None):
    """A micro-batch's share of EPOCH_SUMS, or a step's gradient norm (rank 0 alone): device tensors, no wait."""
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
    """A NaN or infinite loss on any rank stops the run; with fp16's scaler (`allow_nonfinite`), skipping the odd
    overflowing step, only most samples since the last check being so does."""

    def __init__(self, device: torch.device, *, allow_nonfinite: bool):
        self.device, self.allow_nonfinite, self.previous = device, allow_nonfinite, None
        self.slots = [EPOCH_SUMS.index("finite_samples"), EPOCH_SUMS.index("samples")]

    def check(self, sums) -> None:
        """A collective: every rank raises UserError if the loss went non-finite on any. `sums`: the epoch's."""
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
                            "it diverged, and stopped before saving; lower --base-lr, raise --warmup-epochs or use "
                            "--amp bf16, then resume")
        raise UserError("the training loss became NaN or infinite, so training stopped before saving it (the last "
                        "checkpoint is intact): lower --base-lr or raise --warmup-epochs")


def check_parameters_used(model) -> None:
    """A collective after a DDP step: UserError naming parameters with no gradient (else a traceback per rank)."""
    ddp = getattr(model, "_orig_mod", model)
    if not isinstance(ddp, DDP) or ddp.find_unused_parameters:
        return
    mine = [name for name, p in ddp.module.named_parameters() if p.requires_grad and p.grad is None]
    unused = list(dict.fromkeys(name for names in all_gather(mine) for name in names))  # every rank's, in order
    if unused:
        params = dict(ddp.module.named_parameters())
        values = sum(params[name].numel() for name in unused)
        shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise UserError(f"the model's parameters {shown} ({len(unused)} tensors, {values:,} values) got no "
                        f"gradient: DDP needs every parameter in every step's loss; use them or remove them, or "
                        f"pass --find-unused-parameters (which costs DDP a search of the graph every step)")


class RunChecks(StopRequest):
    """What ends a run, agreed by every rank at once: a stop request, a non-finite loss, unreadable samples."""

    def __init__(self, loader, device, *, allow_nonfinite: bool):
        super().__init__()
        self.loader, self.device, self.loss = loader, device, LossCheck(device, allow_nonfinite=allow_nonfinite)

    def check(self, sums) -> bool:
        """Collectives, at the same steps on every rank, before any save: True on all if any was asked to stop."""
        self.loader.check()
        self.loss.check(sums)
        return super().check(self.device)


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
        """Close a trained and evaluated epoch: its row of metrics.jsonl, kept in the history and returned."""
        sums, before = dict(zip(EPOCH_SUMS, self.sums)), self.history[-1] if self.history else {}
        count = sums["samples"]
        # The run's seconds so far, resumes included (a checkpoint from before these fields: its epochs' times).
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
        self.total_time_s, self.total_images = self.total_time_s + self.elapsed_s, self.total_images + int(count)
        self.sums, self.elapsed_s, self.skipped = [0.0] * len(EPOCH_SUMS), 0.0, []
        return metrics


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
    """The newest checkpoint in --out-dir that loads, and the flags to continue it with (or why not, on all)."""
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
    """What a checkpoint holds: `state` (name=object with state_dict()) is required; an option's later state goes
    in `optional` (name: (object, what stands in for it in older checkpoints)); then Progress, config, RNGs."""

    def __init__(self, cfg: RunConfig, env: DistEnv, data, *, model_config: dict, lock=None, optional=None,
                 **state):
        self.cfg, self.env, self.data, self.model_config, self.lock = cfg, env, data, model_config, lock
        self.required, self.optional = state, {}  # name -> object; name -> (object, when absent, start_absent)
        for name, (obj, when_absent) in (optional or {}).items():
            self.add(name, obj, when_absent=when_absent)

    def add(self, name: str, obj, *, when_absent: str, start_absent=lambda: None) -> None:
        """Optional state (None: an option off): a checkpoint without it resumes, calling start_absent(), noted."""
        if obj is not None:
            self.optional[name] = (obj, when_absent, start_absent)

    def objects(self) -> dict:
        return {**self.required, **{name: obj for name, (obj, _, _) in self.optional.items()}}

    def restore(self, found: Found) -> Progress:
        """Load the checkpoint's state; return where training stands (a new run: epoch 0, --init-from's weights)."""
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
        """Refuse to start without room for the next checkpoint (and best.pt with --val-size): rank 0 checks."""
        copies = 2 if self.cfg.val_size else 1
        call_and_agree(check_room, self.cfg.out_dir, self.objects(), copies=copies, here=self.env.is_main)

    def save(self, progress: Progress) -> None:
        """Every rank calls this (it gathers the RNG states); rank 0 writes, unless another run took the out-dir."""
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
        def write(f):  # into a temporary file, renamed over checkpoint.pt once whole (older ones shifted down)
            torch.save(state, f)
        # Every rank holds the same weights: rank 0 alone writes them; if that fails, all leave in one line.
        write_on_main(self.env, lambda: save_checkpoint(out_dir, write, self.cfg.keep_checkpoints, best=best),
                      what=what, out_dir=out_dir, lock=self.lock)


def log_start(cfg: RunConfig, env: DistEnv, data, found: Found) -> None:
    """The original script's first two lines, then the flags changed, the batch split, the LR, the data, notes."""
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
        split = (f"the validation split (--val-size {cfg.val_size})" if cfg.val_size else
                 "the test set (no --val-size: the test set then picks the epoch, and its score is no longer "
                 "an unbiased estimate; --val-size N decides on N held-out training samples)")
        log(f"Early stopping is on: the run ends once {cfg.patience} epoch{'s' if cfg.patience > 1 else ''} in "
            f"a row reach accuracy {cfg.target_accuracy:g} on {split}; --patience 0 trains all {cfg.epochs} epochs")
    notes = [*found.notes, *flag_notes(cfg, found.ckpt)]
    if cfg.comm_hook != "none":  # what compressing the all-reduce changes
        from machinery.comm_hooks import comm_hook_notes
        notes += comm_hook_notes(cfg, found.ckpt, steps=cfg.epochs * math.ceil(len(data.train) / cfg.batch_size))
    for note in notes:
        log(f"note: {note}")


def flag_notes(cfg, ckpt: dict | None = None) -> list:
    """What the flags do that a user likely did not mean, a line each (`ckpt`: the checkpoint resumed, if any)."""
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
