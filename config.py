"""train_ddp.py's flags (one flat argparse config, a line of help each), what a resume does with each (RESUME_RULES),
named presets (--recipe NAME; flags given on the command line win), the argument checks (check_args), and what this
run's world makes of them, computed once (make_config: RunConfig). A flag added here is cfg.<its name> in the recipe.
With no --recipe the defaults are the original script's 5-epoch smoke run, and every modern-recipe option is off.
"""
import argparse
import math
from dataclasses import dataclass, fields

import torch

from machinery.checkpoints import ANY, DATA, MODEL, NOTED, QUIET, RECIPE
from machinery.errors import UserError
from machinery.launch import DistEnv, default_workers

# The WRN paper's CIFAR-100 recipe (Zagoruyko & Komodakis 2016: WRN-16-8, 79.6% top-1; x0.2 at 60/120/160), at batch
# 512 by the linear rule with 5 warm-up epochs; the whole schedule, always: no early stopping (--patience 0).
WRN_PAPER = dict(depth=16, widen_factor=8, dropout=0.0, epochs=200, batch_size=512, base_lr=0.1,
                 reference_batch_size=128, lr_scaling="linear", warmup_epochs=5.0, lr_schedule="step",
                 momentum=0.9, nesterov=True, weight_decay=5e-4, patience=0)

# torch.compile's modes (--compile-mode): bench.py --candidates times each against the default.
COMPILE_MODES = ["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"]

# DDP's communication hooks (--comm-hook), torch's own (torch.distributed.algorithms.ddp_comm_hooks): none is DDP's
# built-in all-reduce of fp32 gradients. docs/comm-hooks.md: where each helps, and what it costs.
COMM_HOOKS = ["none", "fp16", "bf16", "powersgd"]


def depth_arg(text: str) -> int:
    """--depth as argparse reads it: refused on the command line, in one line, unless it is 6n+4 (as
    model.check_depth; the flags import no model)."""
    depth = int(text) if text.lstrip("-").isdigit() else -1
    if depth < 10 or (depth - 4) % 6 != 0:
        raise argparse.ArgumentTypeError(f"WideResNet depth must be 6n+4 with n >= 1 (10, 16, 22, 28, 40, ...), got "
                                         f"{text}")
    return depth


def width_arg(text: str) -> int:
    """--widen-factor as argparse reads it: an integer of at least 1."""
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"WideResNet widen_factor must be an integer >= 1, got {text}")
    return int(text)


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
    g.add_argument("--depth", type=depth_arg, default=16, help="WideResNet depth, 6n+4")
    g.add_argument("--widen-factor", type=width_arg, default=8, help="WideResNet width multiplier k")
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
    g.add_argument("--compile", action="store_true", help="torch.compile the model (slower start, faster steps)")
    g.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile's mode with --compile (reduce-overhead: CUDA graphs)")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic cuDNN and cuBLAS kernels, cudnn.benchmark off: repeatable GPU runs, slower")
    g.add_argument("--tensorboard", action="store_true", help="also log the epoch metrics to out-dir/tensorboard")
    g.add_argument("--profile", action="store_true",
                   help="trace steps 4-8 of the first epoch on each rank into out-dir/profile")
    return p


# What a resume does with each flag (machinery/resume.py: checkpoint_flags reads this table):
#   DATA    what the checkpoint trained on: a run on other data must not continue it (refused);
#   MODEL   what fixes the model's shapes: checked against the checkpoint's model_config (refused);
#   RECIPE  how it trains: changed mid-run it would make the run another recipe (refused);
#   NOTED   may change (the LR, batch size, schedule): the resumed run's log says what changed;
#   QUIET   may change without a word (where files go, how fast, what is scored or logged).
# (RULE, before): for a flag added after checkpoints existed, what an older checkpoint meant (None: the option was
# off, so a value that turns it on changes the run; ANY: any value continues it, as for a decay that means nothing
# while its option is off). A flag added to get_args_parser needs its line here (a unit test checks).
RESUME_RULES = {
    # the original script's flags
    "batch_size": NOTED, "epochs": NOTED, "base_lr": NOTED, "target_accuracy": NOTED, "patience": NOTED,
    # model
    "depth": MODEL, "widen_factor": MODEL, "dropout": NOTED,
    # data
    "dataset": DATA, "data_dir": QUIET, "train_size": DATA, "test_size": DATA, "loader": QUIET, "workers": QUIET,
    "skip_bad_samples": QUIET,
    # optimisation and schedule
    "micro_batch": NOTED, "reference_batch_size": NOTED, "lr_scaling": NOTED, "lr_schedule": NOTED,
    "warmup_epochs": NOTED, "momentum": NOTED, "nesterov": NOTED, "weight_decay": NOTED,
    "label_smoothing": NOTED, "sync_bn": NOTED, "find_unused_parameters": QUIET,
    # what crosses the network: the buckets only group the all-reduce; a hook rounds (fp16, bf16) or approximates
    # (powersgd) the gradients, so a change is noted; PowerSGD restarts on every resume (machinery/comm_hooks.py)
    "bucket_cap_mb": QUIET, "comm_hook": (NOTED, "none"), "powersgd_rank": (NOTED, ANY),
    "powersgd_start": (NOTED, ANY),
    # the modern recipe
    "model_ema": RECIPE, "model_ema_decay": (RECIPE, ANY), "clip_grad_norm": RECIPE, "auto_augment": RECIPE,
    "random_erase": RECIPE, "mixup_alpha": RECIPE, "cutmix_alpha": RECIPE, "norm_weight_decay": RECIPE,
    "tta": QUIET, "val_size": (DATA, 0), "init_from": QUIET,
    # the run
    "recipe": NOTED, "out_dir": QUIET, "seed": DATA, "device": QUIET, "amp": QUIET, "timeout": QUIET,
    "log_every": QUIET, "checkpoint_every": QUIET, "keep_checkpoints": QUIET, "stop_after_epoch": QUIET,
    "evaluate": QUIET, "compile": QUIET, "compile_mode": QUIET, "tensorboard": QUIET, "profile": QUIET,
    "deterministic": (NOTED, False),  # the kernels change, not the recipe: a resume may turn it on or off
}


# ------------------------------------------------------------------------- the argument checks

def check_args(args, world_size: int, device: torch.device) -> None:
    """Reject bad input before any work, with one line that says what to change."""
    if args.batch_size < 1 or (args.batch_size % world_size and not args.evaluate):
        raise UserError(f"--batch-size {args.batch_size} must be a positive multiple of the world size "
                        f"{world_size}; try --batch-size "
                        f"{max(1, round(args.batch_size / world_size)) * world_size}")
    if args.epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {args.epochs}")
    if not 0.0 <= args.target_accuracy <= 1.0:
        raise UserError(f"--target-accuracy is a fraction in [0, 1], got {args.target_accuracy} "
                        f"(85% is 0.85; to train every epoch, turn early stopping off with --patience 0)")
    for name in ("reference_batch_size", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.patience < 0:
        raise UserError(f"--patience is a number of epochs in a row at the target, got {args.patience} "
                        f"(0: no early stopping, every epoch trained)")
    for name in ("train_size", "test_size", "warmup_epochs", "weight_decay", "stop_after_epoch",
                 "checkpoint_every", "skip_bad_samples"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard "
                            "(or pip install -e '.[tensorboard]')") from None
    if args.micro_batch is not None and args.micro_batch < 1:
        raise UserError(f"--micro-batch is the most samples per forward on one rank, at least 1, got "
                        f"{args.micro_batch} (leave it out for no cap)")
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs (torch implements SyncBatchNorm only there); "
                        "leave it out on CPU")
    check_recipe_args(args)
    if args.bucket_cap_mb <= 0:
        raise UserError(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb} (DDP's default: 25)")
    if args.powersgd_rank < 1 or args.powersgd_start < 2:
        raise UserError(f"--powersgd-rank must be at least 1 and --powersgd-start at least 2 (DDP rebuilds its "
                        f"buckets after the first step, which PowerSGD's state must follow), got "
                        f"{args.powersgd_rank} and {args.powersgd_start}")
    if not (0.0 <= args.dropout < 1.0 and 0.0 <= args.label_smoothing < 1.0 and args.base_lr > 0):
        raise UserError("--dropout and --label-smoothing must lie in [0, 1), and --base-lr must be positive")


def check_recipe_args(args) -> None:
    """The modern recipe's flags."""
    if not 0.0 < args.model_ema_decay < 1.0:
        raise UserError(f"--model-ema-decay is the average's decay per reference batch, in (0, 1), got "
                        f"{args.model_ema_decay} (0.999: the last ~1,000 reference batches weigh most)")
    if args.clip_grad_norm is not None and args.clip_grad_norm <= 0:
        raise UserError(f"--clip-grad-norm must be positive, got {args.clip_grad_norm} "
                        f"(leave it out for no clipping)")
    if args.norm_weight_decay is not None and args.norm_weight_decay < 0:
        raise UserError(f"--norm-weight-decay must not be negative, got {args.norm_weight_decay} "
                        f"(leave it out: --weight-decay for all)")
    if not 0.0 <= args.random_erase <= 1.0:
        raise UserError(f"--random-erase is a probability in [0, 1], got {args.random_erase}")
    for name in ("mixup_alpha", "cutmix_alpha", "val_size"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)} "
                            f"(0: off)")


# ----------------------------------------------------------- what the world makes of the flags, computed once

@dataclass(frozen=True, eq=False)
class RunConfig:
    """Every flag and what this run makes of them in its world: built once (make_config), read by training,
    --evaluate and bench.py, stored whole in config.json and every checkpoint. cfg.epochs reads flags["epochs"]."""
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


def make_config(args, env: DistEnv, found=None) -> RunConfig:
    """The run's config from the flags (`found`'s, a train_utils.Found, where its checkpoint rules) and `env`."""
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
        amp_dtype=resolve_amp(args.amp, env.device),
        # One horizon in samples at any batch: a step of B samples decays by D^(B / reference batch) (as torchvision).
        ema_decay=args.model_ema_decay ** (args.batch_size / args.reference_batch_size))


def accumulation_steps(per_rank_batch: int, micro_batch) -> int:
    """The fewest micro-steps that split a rank's batch into equal micro-batches of at most `micro_batch` (None: 1)."""
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
