"""The machinery of train_ddp.py, in two parts.

The first part is what the recipe calls, grouped in the order it calls it: errors, setting up, the
run's shape and LR, the model across ranks, the training loop's stops, checkpoints, and output. The
second part is the machinery behind those calls: launch and network diagnostics, collectives, atomic
files, the out-dir lock, and checkpoint internals. A reader of the recipe needs only the first.

One error protocol throughout: a problem the user can fix is a UserError (exit 2; WriteError, exit 74),
raised on every rank through call_and_agree or write_on_main and said once by rank 0. Nothing runs at
import: signal handlers are installed by the training loop (StopRequest) and removed after it."""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import errno
import faulthandler
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


# =================================================================================================
# Part 1: what train_ddp.py calls, in the order it calls it
# =================================================================================================


# ---------------------------------------------------------------------------- errors: one protocol
# A check raises UserError; call_and_agree (or write_on_main, for rank 0's writes) raises it on every
# rank, so all leave together; main() prints it once, and the exit status says which kind it was.

class UserError(Exception):
    """A problem the user can fix: printed as one line, without a traceback, and the run exits 2."""
    exit_status = 2


class WriteError(UserError):
    """A write of the run's files failed (no space, quota, read-only, permission, I/O error): one line
    that says what failed, why, what is intact and the way out; the run exits 74 (EX_IOERR)."""
    exit_status = 74


class RendezvousError(UserError):
    """init_process_group failed. Every rank that meets it says why: there is no process group to wait
    on, and rank 0 may be the one left waiting (gloo's accepting side waits far longer than --timeout)."""


EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run again (requeue) to resume


def call_and_agree(fn, *args, here: bool = True):
    """fn(*args) on this rank (if `here`), then agree_on_error: a UserError on any rank is raised on
    every rank, and so is an OSError (a missing or unreadable file), named after fn. Returns fn's
    result (None where it did not run)."""
    result, error = None, None
    if here:
        try:
            result = fn(*args)
        except UserError as e:
            error = e
        except OSError as e:
            error = UserError(f"{getattr(fn, '__name__', 'a call')} failed: {e}")
    agree_on_error(error)
    return result


def write_on_main(env: "DistEnv", write, *, what: str, out_dir: str, lock=None,
                  then: str = "run the same command to resume") -> None:
    """Rank 0 runs write(), which writes `what` in out_dir; then every rank learns in one collective
    whether it failed, and all raise the same error and leave together: without this, the others would
    wait in their next collective for a rank 0 that is gone. With `lock`, nothing is written unless
    this run still owns out_dir."""
    error = None
    if env.is_main:
        try:
            if lock is not None:
                lock.check()
            write()
        except UserError as e:
            error = e
        except (OSError, RuntimeError) as e:
            cause = os_error_of(e)
            if cause is None:  # not a failed write (torch.save turns one into a RuntimeError): a bug, with its traceback
                raise
            error = WriteError(describe_write_failure(cause, what, out_dir, then))
    agree_on_error(error)


def leave_on_user_error(e: UserError) -> int:
    """Rank 0 prints the one line; then the ranks leave together, as torchrun kills the other ranks as
    soon as one exits and rank 0 must have said why first. Returns the exit status: 2, or 74 for a
    failed write."""
    if isinstance(e, RendezvousError):  # no process group: every rank says why, as rank 0 may still be waiting
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    log(f"error: {e}", file=sys.stderr)
    if dist.is_initialized():
        dist.barrier()
    elif not read_dist_env().is_main:
        time.sleep(5)
    return e.exit_status


def run_cli(main, parser) -> int:
    """Parse the command line and run main(args, explicit), minus the tracebacks a user should not have
    to read: Ctrl-C before the training loop (which turns later ones into a checkpointed stop), and a hung
    or dead peer, said in one line on every rank instead of a wall of C++ frames."""
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 <pid>`: where is it stuck?
    parser.error = lambda message: refuse_flags(parser, message)
    args = parser.parse_args()
    explicit = explicit_flags(parser, sys.argv[1:])
    try:
        return main(args, explicit)
    except KeyboardInterrupt:
        print(f"rank {read_dist_env().rank}: interrupted outside the training loop; nothing to save", file=sys.stderr,
              flush=True)
        return 130
    except RuntimeError as e:
        if (why := describe_comm_failure(e, args.timeout)) is None:
            raise
        print(f"error: rank {read_dist_env().rank}: {why}", file=sys.stderr, flush=True)
        return 1


# -------------- setting up: who this process is, its device, its flags, its out-dir and checkpoint

@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def read_dist_env() -> DistEnv:
    """Rank and world size from torchrun's environment, from Slurm's under `srun python
    train_ddp.py` (one task per GPU, no torchrun), or a single process under plain python."""
    env = os.environ
    if "RANK" not in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        adopt_slurm_env()
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                       int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    return DistEnv()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU; use --device cpu or auto")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                        f"launch at most that many processes per node (--nproc_per_node)")
    return torch.device("cuda", local_rank)


def init_distributed(env: DistEnv, timeout_s: float) -> None:
    """NCCL with one GPU per LOCAL_RANK on CUDA, gloo on CPU. A no-op for a single plain process."""
    if "RANK" not in os.environ:
        return
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # before init, or every rank piles onto GPU 0
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store across --max-restarts, so restarted ranks would read the dead
        # ranks' gloo addresses (or NCCL id) and wait for them forever: a fresh namespace per attempt.
        # The attempt count is each agent's own, so this is exact on one node only; with several
        # agents, torchrun must not share its store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see below).
        store = dist.PrefixStore(f"attempt_{restart}/", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout))
        if env.is_main and env.world_size > env.local_world_size and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
            print("warning: torchrun shares its rendezvous store with the ranks, so a restart or a node joining "
                  "can hang the other nodes (pytorch/pytorch#135712); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                  "before torchrun, as jobs/multinode.sh does", file=sys.stderr, flush=True)
    try:
        dist.init_process_group(backend, store=store, rank=env.rank if store else -1,
                                world_size=env.world_size if store else -1, timeout=timeout,
                                device_id=env.device if backend == "nccl" else None)
    except Exception as e:  # the store raises several types: DistStoreError, RuntimeError, TimeoutError
        if (why := describe_init_failure(e, env, timeout_s)) is None:
            raise
        raise RendezvousError(why) from None


def check_args(args, world_size: int, device: torch.device) -> None:
    """Reject bad input before any work, with one line that says what to change."""
    if args.batch_size < 1 or (args.batch_size % world_size and not args.evaluate):
        raise UserError(f"--batch-size {args.batch_size} must be a positive multiple of the world size "
                        f"{world_size}; try --batch-size {max(1, round(args.batch_size / world_size)) * world_size}")
    if args.epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {args.epochs}")
    if not 0.0 <= args.target_accuracy <= 1.0:
        raise UserError(f"--target-accuracy is a fraction in [0, 1], got {args.target_accuracy} (85% is 0.85)")
    for name in ("patience", "reference_batch_size", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("train_size", "test_size", "warmup_epochs", "weight_decay", "stop_after_epoch", "checkpoint_every"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard "
                            "(or pip install -e '.[tensorboard]')") from None
    if args.micro_batch is not None and args.micro_batch < 1:
        raise UserError(f"--micro-batch is the most samples per forward on one rank, at least 1, got {args.micro_batch} "
                        f"(leave it out for no cap)")
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs (torch implements SyncBatchNorm only there); leave it out on CPU")
    if not (0.0 <= args.dropout < 1.0 and 0.0 <= args.label_smoothing < 1.0 and args.base_lr > 0):
        raise UserError("--dropout and --label-smoothing must lie in [0, 1), and --base-lr must be positive")


def resolve_amp(amp: str, device: torch.device):
    """The autocast dtype, or None for full fp32."""
    if amp == "auto":
        if device.type != "cuda":
            return None
        # bf16 needs Ampere (8.0) or newer; is_bf16_supported() also says yes where it is only emulated, slowly.
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]


def lock_out_dir(out_dir: str, env: DistEnv):
    """Rank 0 checks that --out-dir is writable and takes it for this run; every rank raises the
    UserError that says why not. Returns the OutDirLock on rank 0, None on the others."""
    def check_and_acquire():
        check_writable(out_dir)
        try:
            return OutDirLock(out_dir).acquire()
        except OSError as e:  # it was writable a moment ago: a full disk or quota, most likely
            raise WriteError(describe_write_failure(e, "the lock", out_dir)) from None

    lock = call_and_agree(check_and_acquire, here=env.is_main)  # one agreement for both steps
    if lock and lock.note:
        log(f"note: {lock.note}")
    return lock


def find_checkpoint(args, explicit: set, env: DistEnv):
    """The checkpoint this run continues (or --evaluate scores), its path, and notes on what this run
    changes; (None, None, []) for a new run. Raises UserError on every rank if it cannot continue it
    (the data and the model are checked once loaded: check_same_data, check_same_model)."""
    found = call_and_agree(load_latest_checkpoint, args.out_dir, env.device, args.keep_checkpoints)
    ckpt, path = found or (None, None)
    if args.evaluate and ckpt is None:
        raise UserError(f"--evaluate needs a checkpoint, and there is none in {args.out_dir}")
    if ckpt is not None:
        check_checkpoint_format(ckpt, path)
    notes = call_and_agree(reconcile_with_checkpoint, args, explicit, ckpt)
    call_and_agree(check_same_device, ckpt, path, env.device, args.evaluate)
    return ckpt, path, notes


# ------------------------------- the run's shape: ranks, batch split, LR rule and schedule, config

def gather_ranks(env: DistEnv) -> list:
    """Every rank's host, its address on the way to the rendezvous, the rendezvous address as it
    resolved here, and its device, indexed by rank: the node count, and run.json's record."""
    master = master_address()
    return all_gather({"rank": env.rank, "local_rank": env.local_rank, "host": host_name(),
                       "address": route_source(master) if master else None, "master_address": master,
                       "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"})


def accumulation_steps(per_rank_batch: int, micro_batch) -> int:
    """The fewest micro-steps that split a rank's batch into equal micro-batches of at most
    `micro_batch` samples (None: no cap, one step)."""
    if not micro_batch or micro_batch >= per_rank_batch:
        return 1
    return next(a for a in range(1, per_rank_batch + 1) if per_rank_batch % a == 0 and per_rank_batch // a <= micro_batch)


def scaled_lr(base_lr: float, batch_size: int, reference_batch: int, rule: str) -> float:
    """Scale the LR tuned for `reference_batch` to the global batch (Goyal et al. 2017 for linear)."""
    ratio = batch_size / reference_batch
    return base_lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def lr_factor(start: float, end: float, *, epochs: int, warmup_epochs: float, schedule: str) -> float:
    """Multiplier of the peak LR for a step that trains from `start` to `end`, both in epochs done
    (epoch - 1 + position in the epoch / its samples). Counted in samples, not steps, the schedule
    keeps its place when a resumed run changes the batch size. Linear warm-up, then cosine to 0 at
    the end of training, or the WRN paper's steps (x0.2 at 30%, 60% and 80% of training)."""
    if start < warmup_epochs:
        return min(1.0, end / warmup_epochs)
    if schedule == "step":
        return 0.2 ** sum(start >= m * epochs - 1e-9 for m in (0.3, 0.6, 0.8))  # 1e-9: 0.8 * 7 is 5.6000000000000005
    progress = (start - warmup_epochs) / max(epochs - warmup_epochs, 1e-9)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def run_config(args, env: DistEnv, *, ranks: list, per_rank_batch: int, accum_steps: int, lr: float,
               amp_dtype) -> dict:
    """Every flag, and what this run made of them: printed once, stored in every checkpoint and record."""
    return {**vars(args), "world_size": env.world_size, "nodes": len({r["host"] for r in ranks}),
            "per_rank_batch": per_rank_batch, "accumulation_steps": accum_steps,
            "micro_batch_size": per_rank_batch // accum_steps, "lr": lr,
            "num_workers": args.workers if args.workers >= 0 else default_workers(env),
            "device_type": env.device.type, "amp_dtype": str(amp_dtype)}


# -------------------------------------------------------------------------- the model across ranks
# The bare model under DDP and compile, DDP's gradient sync, BatchNorm buffers, and seeding.

def seed_everything(seed: int) -> None:
    import random
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


def to_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model on its device; on CUDA in channels_last, the layout cuDNN's fastest convolutions want."""
    return model.to(device, memory_format=torch.channels_last if device.type == "cuda" else torch.preserve_format)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP and torch.compile, so saved keys carry no module./_orig_mod. prefix."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def sync_gradients(model, enabled: bool):
    """A context for one backward: DDP all-reduces the gradients in it if `enabled`, and else only
    accumulates them locally (DDP's no_sync), through torch.compile's wrapper; a no-op without DDP."""
    ddp = getattr(model, "_orig_mod", model)
    return ddp.no_sync() if not enabled and isinstance(ddp, DDP) else nullcontext()


def restore_buffers(model: torch.nn.Module, kept: list | None) -> None:
    """Put back copies taken of unwrap(model).buffers() (BatchNorm's running statistics), if any."""
    for buffer, saved in zip(unwrap(model).buffers(), kept or []):
        buffer.copy_(saved)


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank. In training each rank's
    running statistics drift apart (each sees its own batches), and DDP only re-sends rank 0's at
    the start of each training forward; evaluation uses the bare model, so it sends them here, on
    every rank, whatever its test shard: every rank then evaluates the same model, and the one
    rank 0 saves."""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


# --------------------------------------------------- the training loop: loss sums and agreed stops
# What each step needs, the loss sums, and the stops all ranks agree on: signals, the stop file, a
# non-finite loss.

@dataclass
class RunContext:
    """What train_one_epoch needs besides the model, the optimizer and the data; made once by train()."""
    args: object                 # the flags
    env: DistEnv                 # rank, world size, device
    amp_dtype: object            # the autocast dtype, or None for fp32
    peak_lr: float               # the LR scaled for the global batch, before warm-up and schedule
    n_train: int                 # training samples per epoch
    stop: "StopRequest"          # signals and the stop file, agreed on by all ranks
    progress_log: "ProgressLog"  # rank 0's progress lines
    save_state: object           # writes a checkpoint; every rank calls it


def loss_stats(loss_sum: torch.Tensor, n: int) -> torch.Tensor:
    """A micro-batch's share of the epoch's sums, from its summed loss over n samples: the loss sum
    if finite, n if it is, and n. Device tensors only, so nothing waits for the GPU."""
    finite = torch.isfinite(loss_sum)
    one = torch.ones((), dtype=torch.float64, device=loss_sum.device)
    return torch.stack([torch.where(finite, loss_sum.double(), 0.0), finite.double() * n, one * n])


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


STOP_CHECK_EVERY = 10  # steps between the ranks' checks for a stop request or a non-finite loss


class StopRequest:
    """Set by SIGUSR1 or SIGTERM (Slurm's time-limit warning, scancel, preemption), by Ctrl-C
    (SIGINT; a second one quits at once), or by the file named in $DDP_STOP_FILE (which the job
    scripts create when their shell is signalled, as that reaches every rank on every node, in a
    container too). Ranks agree in `check`."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal = None
        self.stop_file = os.environ.get("DDP_STOP_FILE")
        self.prev_sums = None  # the sums at the previous check (fp16's divergence test)
        self._previous = {}  # the handlers before __enter__

    def __enter__(self) -> "StopRequest":
        """Catch the signals while the training loop runs (`with StopRequest() as stop:`); outside it,
        Ctrl-C and SIGTERM act as usual."""
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def reason(self) -> str:
        """Why the run stops, for its log line: the signal or stop file seen here, else another rank's."""
        return self.signal or "on another rank"

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signal == "SIGINT":
            _say("\nSecond Ctrl-C: quitting now, without a checkpoint (the last one is intact).\n")
            os._exit(130)
        if signum == signal.SIGINT:
            _say("\nCtrl-C: stopping at the next check (within 10 steps) with a checkpoint; Ctrl-C again to quit now.\n")
        self.signal = signal.Signals(signum).name

    def requested_here(self) -> bool:
        if self.signal is None and self.stop_file and os.path.exists(self.stop_file):
            self.signal = f"stop file {self.stop_file}"
        return self.signal is not None

    def check(self, device, sums, allow_nonfinite: bool) -> bool:
        """One small all-reduce: True if any rank was asked to stop. Raises if any rank's loss went
        non-finite (`sums`, a tensor or list as from loss_stats: this epoch's loss * n, finite n, n). With
        fp16 the grad scaler skips the odd overflowing step, so only divergence stops the run: a majority
        of non-finite losses since the previous check."""
        sums = torch.as_tensor(sums, dtype=torch.float64, device=device)
        if allow_nonfinite:
            prev = self.prev_sums if self.prev_sums is not None else torch.zeros_like(sums)
            prev = torch.where(sums[2] >= prev[2], prev, 0.0)  # the sums restarted with a new epoch
            self.prev_sums = sums.clone()
            finite, count = sums[1] - prev[1], sums[2] - prev[2]
            diverged = finite < 0.5 * count
        else:
            diverged = sums[1] < sums[2]
        flags = torch.stack([torch.full((), float(self.requested_here()), device=device),
                             diverged.to(device=device, dtype=torch.float32)])
        stop, bad = all_reduce_max(flags).tolist()
        if bad and allow_nonfinite:
            raise UserError("the training loss was NaN or infinite in most fp16 steps since the last check: training "
                            "diverged, and stopped before saving; lower --base-lr, raise --warmup-epochs or use "
                            "--amp bf16, then run again to resume from the last checkpoint")
        if bad:
            raise UserError("the training loss became NaN or infinite, so training stopped before saving "
                            "anything from it (the last checkpoint is intact): lower --base-lr or raise --warmup-epochs")
        return bool(stop)


def stop_or_checkpoint_mid_epoch(run: RunContext, progress, sums: torch.Tensor, *, t0: float,
                                 allow_nonfinite: bool) -> bool:
    """Every STOP_CHECK_EVERY steps the ranks agree whether to stop (a signal, the stop file) and check
    the loss; a stop, or --checkpoint-every, saves a checkpoint mid-epoch. True if the ranks stop now."""
    args, step = run.args, progress.step
    checkpoint_due = args.checkpoint_every and step % args.checkpoint_every == 0
    if step % STOP_CHECK_EVERY and not checkpoint_due:
        return False
    stopping = run.stop.check(run.env.device, sums, allow_nonfinite)  # all ranks agree
    if stopping or checkpoint_due:
        progress.elapsed_s = time.perf_counter() - t0
        progress.sums = all_reduce_sum(sums.clone()).tolist()
        run.save_state()
    if stopping:
        log(f"Stop requested ({run.stop.reason}) in epoch {progress.epoch + 1} after step {step}: "
            f"checkpoint saved in {args.out_dir}; exiting with status {EXIT_STOPPED} to be resumed.")
    return stopping


@dataclass
class Progress:
    """Where training stands. Saved in every checkpoint, so a run resumes mid-epoch exactly."""
    epoch: int = 0              # epochs completed
    position: int = 0           # samples of epoch + 1's order trained so far (global, all ranks)
    step: int = 0               # steps taken in epoch + 1 (for the progress lines and --checkpoint-every)
    sums: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # that epoch so far: loss * n, n (finite), n
    elapsed_s: float = 0.0      # that epoch's training time so far
    history: list = field(default_factory=list)  # one metrics dict per completed epoch
    total_time_s: float = 0.0
    total_images: int = 0
    stopped_early: bool = False

    def epochs_left(self, epochs: int) -> range:
        """The epochs still to train, the first maybe begun: none once early stopping ended the run."""
        return range(self.epoch + 1, epochs + 1) if not self.stopped_early else range(0)

    def finish_epoch(self, metrics: dict, patience: int, target_accuracy: float) -> None:
        """Close a trained and evaluated epoch: keep its metrics, decide early stopping (from the
        all-reduced accuracy, so every rank decides alike), and start the next at its beginning."""
        self.history.append(metrics)
        recent = [m["val_acc"] for m in self.history[-patience:]]
        self.stopped_early = len(recent) == patience and min(recent) >= target_accuracy
        self.epoch, self.position, self.step = metrics["epoch"], 0, 0
        self.total_time_s += self.elapsed_s
        self.total_images += int(self.sums[2])
        self.sums, self.elapsed_s = [0.0] * 3, 0.0


# ----------------------------------------------------------- checkpoints: checked, restored, saved
# A run continues only its own checkpoint; a checkpoint is written whole or not at all.

def check_same_data(ckpt, args, shape: dict, fingerprints: dict) -> None:
    """Raise UserError unless the data just loaded are those the checkpoint trained on: first their shape
    (`shape`: DataSpec.shape() or dataset_utils.image_shape()), then the samples themselves (same flags,
    other files)."""
    if ckpt is None:
        return
    saved_shape = {k: ckpt["config"]["data_spec"][k] for k in shape}
    if saved_shape != shape:
        raise UserError(f"load_data gives {describe_shape(shape)}, but the checkpoint in {args.out_dir} was trained "
                        f"on {describe_shape(saved_shape)}: use another --out-dir for a new run, or load the data "
                        f"it trained on")
    saved = ckpt["data"]
    for split, fp in fingerprints.items():
        if saved[split] != fp:
            raise UserError(f"the {split} data in --data-dir {args.data_dir} differ from those the checkpoint in "
                            f"{args.out_dir} was trained on (fingerprint {fp}, checkpoint {saved[split]}): point "
                            f"--data-dir at the same data, or use another --out-dir for a new run")


def check_same_model(ckpt, path: str, model_config: dict) -> None:
    """Raise UserError unless this run builds the model the checkpoint holds (its model_config)."""
    if ckpt is not None and ckpt["model_config"] != model_config:
        raise UserError(f"{path} holds {describe_model(ckpt['model_config'])}, but this run builds "
                        f"{describe_model(model_config)} (model_config in train_ddp.py): build the same model, or "
                        f"use another --out-dir")


def describe_model(cfg: dict) -> str:
    """A model_config in words: its "name" (else its keys and values), and its classes."""
    name = cfg.get("name") or ", ".join(f"{k} {v}" for k, v in cfg.items() if k != "num_classes")
    return f"{name} with {cfg['num_classes']} classes" if "num_classes" in cfg else name



def restore_checkpoint(ckpt, path: str, *, model, optimizer, scaler, args, env: DistEnv, config: dict) -> Progress:
    """Load the checkpoint's state into this run's objects; say what changed. Returns its Progress, or a
    new one (epoch 0) if there is no checkpoint."""
    if ckpt is None:
        return Progress()
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt["scaler"]:  # empty unless that run used fp16
        scaler.load_state_dict(ckpt["scaler"])
    saved = ckpt["config"]
    progress = Progress(**ckpt["progress"])
    if saved["lr"] != config["lr"]:
        log(f"note: the peak LR changed from {saved['lr']:.4g} to {config['lr']:.4g} on resume")
    if saved["batch_size"] != args.batch_size:
        log(f"note: the global batch changed from {saved['batch_size']} to {args.batch_size} on resume: the "
            f"schedule keeps its place in samples (epoch {progress.epoch + 1} resumes at sample "
            f"{progress.position})")
    if (saved["accumulation_steps"], saved["micro_batch_size"]) != (
            config["accumulation_steps"], config["micro_batch_size"]) and saved["world_size"] != env.world_size:
        log(f"note: {saved['world_size']} ranks x {saved['accumulation_steps']} accumulation steps x "
            f"{saved['micro_batch_size']} before, {env.world_size} x "
            f"{config['accumulation_steps']} x {config['micro_batch_size']} now: the same global batch")
    progress.step = -(-progress.position // args.batch_size)
    if ckpt["world_size"] == env.world_size:  # else train()'s seeding serves as well as any
        torch.set_rng_state(ckpt["rng_cpu"][env.rank].cpu())
        if env.device.type == "cuda" and ckpt["rng_cuda"]:
            torch.cuda.set_rng_state(ckpt["rng_cuda"][env.rank].cpu(), env.device)
    log(f"Resumed from {path}: epoch {progress.epoch} of {args.epochs} done"
        + (f", and {progress.position} samples ({progress.step} steps) of the next." if progress.position else "."))
    return progress


def check_room_for_checkpoint(out_dir: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse to start when out_dir has no room for one more checkpoint (the model and the optimizer's
    state, which SGD's momentum makes as large as the model): a run that cannot save would train until
    its first checkpoint for nothing, and a restart after a full disk would do so again and again."""
    tensors = list(model.state_dict().values()) + [p for p in model.parameters() if p.requires_grad]
    need = sum(t.numel() * t.element_size() for t in tensors)
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise WriteError(describe_write_failure(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), out_dir),
                                                f"a checkpoint of about {need / 2**20:.1f} MiB "
                                                f"({free / 2**20:.1f} MiB free)", out_dir))


def training_state(model, *, optimizer, scaler, progress: Progress, config: dict, model_config: dict,
                   fingerprints: dict, device: torch.device) -> dict:
    """Everything a resume needs. A collective: every rank calls it, as it gathers their RNG states."""
    rng_cpu = all_gather(torch.get_rng_state())
    rng_cuda = all_gather(torch.cuda.get_rng_state(device)) if device.type == "cuda" else []
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
            "progress": asdict(progress), "config": config, "model_config": model_config, "data": fingerprints,
            "world_size": len(rng_cpu), "rng_cpu": rng_cpu, "rng_cuda": rng_cuda}


def save_checkpoint(out_dir: str, state: dict, keep: int) -> None:
    """Write the new checkpoint in full to a temporary file, then shift the older ones down and
    rename it into place. A crash at any point leaves the previous checkpoints loadable."""
    paths = checkpoint_paths(out_dir, keep)
    for name in os.listdir(out_dir):  # what a write killed halfway left behind (only rank 0 writes)
        if name.startswith(".checkpoint.") and name.endswith(".tmp"):
            os.unlink(os.path.join(out_dir, name))

    def shift_older():
        for older, newer in zip(reversed(paths[1:]), reversed(paths[:-1])):
            if os.path.exists(newer):
                os.replace(newer, older)
    _atomic_write(paths[0], lambda f: torch.save(state, f), before_replace=shift_older)


def describe_progress(progress) -> str:
    """Where a checkpoint stands: "after epoch 2", or "at step 10 of epoch 3"."""
    if progress.position:
        return f"at step {progress.step} of epoch {progress.epoch + 1}"
    return f"after epoch {progress.epoch}"


# ---------------------------------------------------------- output on rank 0 and the run's records
# One print for the whole job: the original script's lines, progress lines, and the run's files.

def log(*args, **kwargs) -> None:
    """print on rank 0 only, flushed, so logs are not multiplied by the world size. Rank 0 is known
    before the process group exists (read_dist_env), so argparse's errors are said once too."""
    if read_dist_env().is_main:
        print(*args, **kwargs, flush=True)


class ProgressLog:
    """Rank 0's progress inside an epoch: a live line on a terminal, or one line every `every`
    steps in a batch log (no TTY). Reading the loss syncs rank 0 with its GPU, so only then."""

    def __init__(self, every: int):
        self.is_main = read_dist_env().is_main
        self.tty = self.is_main and sys.stdout.isatty()
        self.every = 0 if every <= 0 else (min(every, 10) if self.tty else every)  # 0: no progress lines
        self.shown = False

    def due(self, step: int) -> bool:
        """Every `every` steps, and after the run's first step: a slow start still shows signs of life."""
        return self.is_main and self.every > 0 and (step % self.every == 0 or not self.shown)

    def show(self, epoch: int, step: int, steps: int, images: float, loss: float, elapsed: float) -> None:
        self.shown = True
        eta = elapsed / max(step, 1) * (steps - step)
        line = (f"  epoch {epoch} step {step}/{steps} | {images / max(elapsed, 1e-9):.0f} img/s | "
                f"loss {loss:.4f} | epoch ETA {eta:.0f} s")
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", flush=True)

    def update(self, epoch: int, step: int, steps: int, images: float, sums: torch.Tensor, t0: float) -> None:
        """Show the line if one is due: it reads the loss, a wait for the GPU, so not every step."""
        if self.due(step):
            self.show(epoch, step, steps, images, sums[0].item() / max(sums[1].item(), 1), time.perf_counter() - t0)

    def clear(self) -> None:
        if self.tty:
            print("\r" + " " * 100 + "\r", end="", flush=True)


def log_start(config: dict, env: DistEnv, notes: list) -> None:
    """The original script's first two lines, then the config, the batch split and the LR, and any notes."""
    unit = "GPUs" if env.device.type == "cuda" else "CPU processes"
    log(f"Training started with {env.world_size} processes across {config['nodes']} nodes.")
    log(f"Using {env.local_world_size} {unit} per node.")
    log("Config: " + json.dumps(config))
    accum = config["accumulation_steps"]
    split = (f"{env.world_size} ranks x {accum} accumulation steps x {config['micro_batch_size']}" if accum > 1
             else f"{env.world_size} ranks x {config['per_rank_batch']}")
    log(f"Global batch {config['batch_size']} = {split}; LR {config['lr']:.4g} ({config['lr_scaling']} scaling of "
        f"{config['base_lr']:g} from batch {config['reference_batch_size']})")
    for note in notes:
        log(f"note: {note}")


def log_data(data, n_train: int, n_test: int) -> dict:
    """One line on what the data say of themselves; returns it as the config stores it."""
    log(f"Data: {n_train} training and {n_test} test images of {data.channels} x {data.height} x {data.width}, "
        f"{data.num_classes} classes; per-channel mean {tuple(round(m, 4) for m in data.mean)}, "
        f"std {tuple(round(s, 4) for s in data.std)}")
    return asdict(data)


def log_epoch(metrics: dict, epochs: int, n_finite: float) -> None:
    """The original script's four lines per epoch, and a warning if fp16's scaler skipped steps."""
    log(f"Epoch {metrics['epoch']}/{epochs} completed in {metrics['epoch_time_s']:.3f} seconds")
    log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
    log(f"Epoch Throughput: {metrics['images_per_s']:.3f} images/second")
    log(f"Train Loss: {metrics['train_loss']:.4f}, Validation Top-5 Accuracy: {metrics['val_top5']:.4f}")
    if n_finite < metrics["train_samples"]:
        log(f"warning: {int(metrics['train_samples'] - n_finite)} samples had a non-finite fp16 loss; "
            f"the scaler skipped their steps")


def epoch_metrics(epoch: int, progress, val: dict, lr: float) -> dict:
    """The epoch's row of metrics.jsonl: the training loss and samples (all-reduced), the test
    metrics, the LR of its last step, and its time."""
    loss_sum, n_finite, count = progress.sums
    return {"epoch": epoch, "train_loss": loss_sum / max(n_finite, 1), "train_samples": int(count), **val,
            "lr": lr, "epoch_time_s": progress.elapsed_s, "images_per_s": count / progress.elapsed_s}


class Records:
    """The run's files, written by rank 0 and agreed on by all ranks (write_on_main: a failed write ends
    every rank with one line): config.json, metrics.jsonl (a row per epoch, rewritten whole from the
    checkpoint's history at each start and epoch, so it never holds a partial line or an epoch that
    trains again), run.json, TensorBoard; at the end summary.json, and the original script's summary lines."""

    def __init__(self, args, env: DistEnv, *, config: dict, ranks: list, history: list, lock):
        self.args, self.env, self.config, self.ranks, self.lock = args, env, config, ranks, lock
        self.metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
        self.rows = [json.dumps(m) + "\n" for m in history]
        self.record, self.tensorboard = run_record(config, ranks) if env.is_main else None, None

        def write_start():
            write_json(os.path.join(args.out_dir, "config.json"), config)
            write_text(self.metrics_path, "".join(self.rows))
            write_json(os.path.join(args.out_dir, "run.json"), self.record)
            if args.tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # optional; check_args made sure it imports
                self.tensorboard = SummaryWriter(os.path.join(args.out_dir, "tensorboard"))
        self._write(write_start, "the run's records (config.json, metrics.jsonl, run.json)")

    def _write(self, write, what: str) -> None:
        write_on_main(self.env, write, what=what, out_dir=self.args.out_dir, lock=self.lock)

    def add_epoch(self, metrics: dict) -> None:
        self.rows.append(json.dumps(metrics) + "\n")

        def write_epoch():
            write_text(self.metrics_path, "".join(self.rows))  # whole, atomically: never a partial last line
            if self.tensorboard:
                for key, value in metrics.items():
                    self.tensorboard.add_scalar(key, value, metrics["epoch"])
                self.tensorboard.flush()  # a preempted run keeps its curves too
        self._write(write_epoch, f"epoch {metrics['epoch']}'s metrics")

    def finish(self, progress, n_train: int, n_test: int) -> None:
        env, history, total_s = self.env, progress.history, progress.total_time_s
        summary = {
            "total_time_s": total_s, "world_size": env.world_size, "nodes": self.config["nodes"],
            "images_per_s": progress.total_images / total_s if total_s else 0.0,
            "gpus_per_node": env.local_world_size, "device": env.device.type,
            "hosts": sorted({r["host"] for r in self.ranks}), "epochs_completed": progress.epoch,
            "finished": progress.stopped_early or progress.epoch >= self.args.epochs,
            "stopped_early": progress.stopped_early, "best_val_acc": max((m["val_acc"] for m in history), default=0.0),
            "final_val_acc": history[-1]["val_acc"] if history else 0.0, "n_train": n_train, "n_test": n_test,
            "config": self.config,
        }

        def write_end():
            write_json(os.path.join(self.args.out_dir, "summary.json"), summary)
            write_json(os.path.join(self.args.out_dir, "run.json"), {**self.record, "end_time": now_iso()})
            if self.tensorboard:
                self.tensorboard.close()
        self._write(write_end, "the run's summary (summary.json, run.json)")
        log("\nTraining Summary:")
        log(f"Total training time: {total_s:.3f} seconds")
        log(f"Throughput: {summary['images_per_s']:.3f} images/second")
        unit = "GPUs" if env.device.type == "cuda" else "CPU processes"  # as the start lines say
        log(f"Number of nodes: {summary['nodes']}")
        log(f"Number of {unit} per node: {env.local_world_size}")
        log(f"Total {unit} used: {env.world_size}")
        log("Training completed successfully." if summary["finished"] else
            f"Training paused after epoch {progress.epoch} of {self.args.epochs}; run again to resume.")


def record_evaluation(metrics: dict, *, out_dir: str, epoch: int, env: DistEnv, path: str) -> None:
    """--evaluate's two lines, and eval.json."""
    log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
    log(f"Validation Top-5 Accuracy: {metrics['val_top5']:.4f} on {metrics['val_count']} images")
    record = {**metrics, "epoch": epoch, "world_size": env.world_size, "checkpoint": path}
    write_on_main(env, lambda: write_json(os.path.join(out_dir, "eval.json"), record), what="eval.json",
                  out_dir=out_dir, then="evaluate again")


# =================================================================================================
# Part 2: the machinery behind those calls
# =================================================================================================


# ------------------------------------------------------------------------------ launch and network
# torchrun's, Slurm's or no launcher's environment, and why a rendezvous failed.

def adopt_slurm_env() -> None:
    """Translate an srun step's variables into torchrun's, so init_process_group("env://") works.
    The master is the allocation's first node; the port is derived from the job id, so that two
    jobs sharing a node do not collide."""
    env = os.environ
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = env.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]
    if "MASTER_ADDR" not in env:
        import subprocess
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                                 check=True, timeout=30).stdout.split()
            env["MASTER_ADDR"] = out[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["MASTER_ADDR"] = env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def default_workers(env: DistEnv) -> int:
    """DataLoader workers per rank for --workers -1: the rank's share of the CPUs it may use, at most
    8. torchrun's ranks share their CPUs; srun's tasks (jobs/srun_direct.sh) each have their own."""
    cpus = len(os.sched_getaffinity(0))
    return min(8, cpus // env.local_world_size if "TORCHELASTIC_RUN_ID" in os.environ else cpus)


def describe_init_failure(e: Exception, env: DistEnv, timeout_s: float) -> str | None:
    """One line for an init_process_group that failed, else None: a peer advertised a loopback address
    (gloo's connect to it is refused within seconds: ranks bound to an interface that other nodes cannot
    reach), or the rendezvous timed out."""
    text = str(e)
    peer = re.search(r"remote=\[([^\]]+)\]", text)
    if "connectFullMesh" in text and peer and (peer.group(1).startswith("127.") or peer.group(1) == "::1"):
        ifname = next((f"{v}={os.environ[v]}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                       if os.environ.get(v)), None)
        cause = (f"{ifname} names an interface the other nodes cannot reach: set it to the interface that "
                 f"carries the node's address (ip -br addr), or unset it" if ifname else
                 "the hostname resolves to a loopback address: map it to the node's address in /etc/hosts or "
                 "DNS, or set GLOO_SOCKET_IFNAME to the interface that carries that address")
        return (f"rank {env.rank} on {host_name()} cannot connect to another rank at {peer.group(1)}, a loopback "
                f"address, so ranks on different nodes cannot meet: {cause}")
    if _is_timeout(e):
        return (f"rank {env.rank} timed out after {timeout_s:g} s in init_process_group waiting for all "
                f"{env.world_size} ranks at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}: "
                f"check that every node started and can reach that address, or raise --timeout")
    return None


def host_name() -> str:
    """The node's name: Slurm's when under Slurm (several slurmd may share one test host)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def route_source(ip: str) -> str | None:
    """The local address this node's traffic to `ip` leaves from, so the interface it leaves by (a UDP
    connect sends nothing). None if there is no route."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def master_address() -> str | None:
    """MASTER_ADDR as it resolves on this node: the address this rank met the others at. None for a
    single process."""
    try:
        return socket.gethostbyname(os.environ["MASTER_ADDR"]) if "MASTER_ADDR" in os.environ else None
    except OSError:
        return None


# ----------------------------------------------------------- collectives and failures across ranks

def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_gather(obj):
    """Every rank's `obj`, as a list indexed by rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree_on_error(error: UserError | None) -> None:
    """One collective: if any rank hit a UserError, the first one is raised on every rank (with its
    class, so its exit status), and no rank is left waiting for another in a later collective."""
    errors = [(r, e) for r, e in enumerate(all_gather(error)) if e is not None]
    if errors:
        rank, e = errors[0]
        raise type(e)(f"{e} (on rank {rank})" if dist.is_initialized() and rank != 0 else str(e))


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind `e`: itself, or one in its chain (torch.save reports a failed write of its zip
    as RuntimeError "unexpected pos ..." raised while handling the OSError)."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def _is_timeout(e: Exception) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def describe_comm_failure(e: Exception, timeout_s: float) -> str | None:
    """A one-line explanation if `e` is a collective that failed for want of a peer (hung: a
    timeout; dead: its connection closed), else None."""
    first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if _is_timeout(e):
        return (f"a collective operation timed out after {timeout_s:g} s: another rank is hung or dead "
                f"(send it SIGUSR2 to see where it is stuck); {first}")
    if any(s in str(e) for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe")):
        return (f"lost another rank (its process or node died): {first}; the last checkpoint is intact, "
                f"and torchrun --max-restarts (or a requeue) resumes from it")
    return None


def refuse_flags(parser, message: str):
    """argparse's error, in this script's form: one `error:` line from rank 0 (every rank parses the
    same command line and leaves with it), exit status 2."""
    if read_dist_env().is_main:
        parser.print_usage(sys.stderr)
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
    sys.exit(2)


def explicit_flags(parser, argv) -> set:
    """The flags given on the command line, as argparse dests (the rest are defaults)."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(argv)))


# ---------------------------------------------- files: atomic writes, and what a failed write says
# A reader sees the old file or the new one, never half of one.

def write_json(path: str, obj) -> None:
    """Write JSON atomically: a temporary file in the same directory, then a rename."""
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))


def write_text(path: str, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode()))


def _atomic_write(path: str, write, before_replace=None) -> None:
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace:
            before_replace()
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
        _fsync_dir(d)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(d: str) -> None:
    """Make the renames in `d` durable, so a node crash right after a save keeps the new file."""
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some network filesystems refuse fsync on a directory; the rename still stands
        pass


# The way out of a failed write, by the OS's reason ({d}: the out-dir).
WAY_OUT = {
    errno.ENOSPC: "free space in {d} (or use another --out-dir)",
    errno.EDQUOT: "free space under your quota (or use another --out-dir)",
    errno.EROFS: "{d} is on a read-only filesystem: use another --out-dir",
    errno.EACCES: "make {d} writable for you, or use another --out-dir",
    errno.EPERM: "make {d} writable for you, or use another --out-dir",
    errno.ENOENT: "{d}, or a file in it, was removed while the run wrote there: put it back",
    errno.EIO: "the filesystem failed: check it, or use another --out-dir",
}


def describe_write_failure(e: OSError, what: str, out_dir: str, then: str = "run the same command to resume") -> str:
    """One line for a failed write: what failed, where, the OS's reason, what is intact, the way out."""
    reason = (e.strerror or str(e)).lower()
    named = e.filename and not os.path.basename(str(e.filename)).startswith(".")  # not one of our temporary files
    way_out = WAY_OUT.get(e.errno, "fix that").format(d=out_dir)
    return (f"{reason} writing {what} in {e.filename if named else out_dir}; {describe_intact(out_dir)}: "
            f"{way_out}, then {then}")


def describe_intact(out_dir: str) -> str:
    """What a failed write leaves safe: the newest checkpoint that loads, read back from the disk."""
    for path in checkpoint_paths(out_dir, 10):
        try:  # mmap: only the small progress record is read, whatever the model's size
            p = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["progress"]
        except Exception:  # missing, or the one a crash cut short: the next one back
            continue
        return f"the last good checkpoint, {path} ({describe_progress(Progress(**p))}), is intact"
    return "no checkpoint was written yet"


def check_writable(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UserError(f"--out-dir {out_dir} is not writable ({e.strerror}); choose another directory") from None


# ----------------------------------------------------------------------------- one run per out-dir
# Two runs must never write one checkpoint; a dead run must not lock out the next.

class OutDirLock:
    """The out-dir belongs to one run at a time: rank 0 holds `run.lock` while it trains.

    The file names its owner (host, process, Slurm job) and is touched every HEARTBEAT_S seconds.
    A second run refuses to start while the owner lives. The lock never outlives its owner: it is
    taken over when the owner's process is gone (same host), when it is an earlier run of the same
    Slurm job or torchrun (a requeue, a restart: those end the old run first), or when its
    heartbeat is older than STALE_S (its node died). It is created with link(2), which is atomic
    on NFS, Lustre and GPFS too, and the owner re-reads it before each checkpoint, so even a lock
    taken over by mistake cannot let two runs write one checkpoint."""
    NAME, HEARTBEAT_S, STALE_S = "run.lock", 10.0, 60.0

    def __init__(self, out_dir: str):
        self.out_dir, self.path = out_dir, os.path.join(out_dir, self.NAME)
        self.me = {"host": host_name(), "pid": os.getpid(), "started": _process_start(os.getpid()),
                   "slurm_job": os.environ.get("SLURM_JOB_ID"), "torchrun": os.environ.get("TORCHELASTIC_RUN_ID"),
                   "token": os.urandom(8).hex(), "since": now_iso()}
        self.note, self._done = None, threading.Event()

    def acquire(self) -> "OutDirLock":
        for _ in range(5):
            tmp = f"{self.path}.{self.me['token']}"
            with open(tmp, "w") as f:
                json.dump(self.me, f)
            try:
                os.link(tmp, self.path)  # fails if the lock exists: no two runs can both succeed
                break
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
            holder, age = self._read(age=True)
            why_stale = self._why_stale(holder, age)
            if why_stale is None:
                raise UserError(f"--out-dir {self.out_dir} is in use by another run ({describe_owner(holder)}, alive "
                                f"{age:.0f} s ago): wait for it to end or use another --out-dir (if that run is "
                                f"surely gone, delete {self.path})")
            self._break(holder)
            self.note = f"took over {self.path} from {describe_owner(holder)}: {why_stale}"
        else:
            raise UserError(f"could not take {self.path}: other runs keep taking it; use another --out-dir")
        threading.Thread(target=self._beat, name="out-dir heartbeat", daemon=True).start()
        return self

    def check(self) -> None:
        """Raise unless this run still owns the out-dir (called before each checkpoint)."""
        holder, _ = self._read()
        if holder is None:
            raise UserError(f"this run's lock {self.path} is gone (deleted, or --out-dir removed), so this run stops "
                            f"without writing there; if no other run uses {self.out_dir}, run the same command to resume")
        if holder.get("token") != self.me["token"]:
            raise UserError(f"another run took over --out-dir {self.out_dir} ({describe_owner(holder)}), so this one "
                            f"stops without writing there; run one job per out-dir")

    def release(self) -> None:
        self._done.set()
        holder, _ = self._read()
        if holder and holder.get("token") == self.me["token"]:
            try:
                os.unlink(self.path)
            except OSError:  # a filesystem turned read-only: the next run takes the lock over (its owner is gone)
                pass

    def _beat(self) -> None:
        while not self._done.wait(self.HEARTBEAT_S):
            try:
                holder, _ = self._read()
                if holder and holder.get("token") == self.me["token"]:
                    os.utime(self.path)
            except OSError:  # a filesystem hiccup: the next beat tries again
                pass

    def _read(self, age: bool = False):
        """The owner's record, and with `age` the seconds since its last heartbeat by the filesystem's
        clock (the nodes' clocks may differ from the file server's)."""
        try:
            with open(self.path) as f:
                holder, mtime = json.load(f), os.fstat(f.fileno()).st_mtime
        except (OSError, ValueError):
            return None, 0.0
        if not age:
            return holder, 0.0
        with tempfile.NamedTemporaryFile(dir=self.out_dir, prefix=".clock-") as probe:
            now = os.fstat(probe.fileno()).st_mtime
        return holder, max(0.0, now - mtime)

    def _why_stale(self, holder, age: float) -> str | None:
        if holder is None:
            return "it was unreadable" if os.path.exists(self.path) else "it was just released"
        if holder["host"] == self.me["host"]:
            if _process_start(holder["pid"]) != holder.get("started"):
                return f"its process {holder['pid']} is gone"
            return None  # alive on this very host: another run (or another step of this job)
        if self.me["slurm_job"] and holder.get("slurm_job") == self.me["slurm_job"]:
            return f"it was an earlier run of this Slurm job {self.me['slurm_job']} (requeued)"
        if self.me["torchrun"] not in (None, "none") and holder.get("torchrun") == self.me["torchrun"]:
            return "it was an earlier attempt of this torchrun job (restarted)"
        if age > self.STALE_S:
            return f"no heartbeat for {age:.0f} s (its node is gone)"
        return None

    def _break(self, holder) -> None:
        """Move the stale lock aside; of several runs racing for it, only one moves the same file."""
        aside = f"{self.path}.stale.{self.me['token']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            with open(aside) as f:
                moved = json.load(f)
        except (OSError, ValueError):
            moved = None
        if holder and moved and moved.get("token") != holder.get("token"):
            try:  # we moved a fresh lock that another run had just taken: give it back
                os.link(aside, self.path)
            except FileExistsError:
                pass
        os.unlink(aside)


def _process_start(pid: int):
    """The process's start time (clock ticks since boot), or None if there is no such process:
    with the pid, it names a process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        try:
            os.kill(pid, 0)
            return 0  # alive, start time unknown (no /proc)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0


def describe_owner(holder) -> str:
    if not holder:
        return "unknown"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"host {holder['host']}, pid {holder['pid']}{job}, since {holder.get('since', '?')}"


# ----------------------------- checkpoint internals: paths, loading, and what may change on resume

def checkpoint_paths(out_dir: str, keep: int) -> list:
    """checkpoint.pt is the newest; checkpoint.1.pt the one before, and so on."""
    return [os.path.join(out_dir, "checkpoint.pt")] + [
        os.path.join(out_dir, f"checkpoint.{i}.pt") for i in range(1, keep)]


def load_checkpoint(path: str, device: torch.device) -> dict:
    try:
        # weights_only: a checkpoint is data, never code; this refuses pickled objects.
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise UserError(f"{path} cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def load_latest_checkpoint(out_dir: str, device: torch.device, keep: int):
    """The newest checkpoint that loads, and its path; (None, None) if there is none. Unreadable
    ones (truncated, corrupt, or holding pickled code) are skipped with a warning, and if none can
    be read the run refuses to start rather than overwrite them."""
    problems = []
    for path in checkpoint_paths(out_dir, max(keep, 10)):
        if not os.path.exists(path):
            continue
        try:
            ckpt = load_checkpoint(path, device)
            if not isinstance(ckpt, dict) or "model" not in ckpt or "progress" not in ckpt:
                raise UserError(f"{path} is not a checkpoint of this script")
        except UserError as e:
            problems.append(str(e))
            continue
        for p in problems:
            log(f"warning: {p}; using the older {path}", file=sys.stderr)
        return ckpt, path
    if problems:
        raise UserError(f"no usable checkpoint in {out_dir}: {problems[0]}; move the checkpoint files "
                        f"away to start afresh")
    return None, None


# What this version reads from a checkpoint (training_state writes it all).
CHECKPOINT_KEYS = ("model", "optimizer", "scaler", "progress", "config", "model_config", "data", "world_size",
                   "rng_cpu", "rng_cuda")


CHECKPOINT_CONFIG_KEYS = ("data_spec", "batch_size", "per_rank_batch", "accumulation_steps", "micro_batch",
                          "micro_batch_size", "lr", "device_type")


def check_checkpoint_format(ckpt, path: str) -> None:
    """Raise UserError unless `ckpt` holds everything this version reads: an older train_ddp.py's checkpoint
    is refused in one line, never half-read with guessed defaults."""
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt]
    missing += [f"config.{k}" for k in CHECKPOINT_CONFIG_KEYS if k not in ckpt.get("config", {})]
    missing += [f"progress.{f.name}" for f in fields(Progress) if f.name not in ckpt.get("progress", {})]
    if missing:
        raise UserError(f"{path} was written by an older train_ddp.py (it lacks {', '.join(missing[:3])}); evaluate "
                        f"or resume it with that version, or train afresh in another --out-dir")


# What a checkpoint's run trained on: a run on other data must not continue it.
DATA_FLAGS = ("dataset", "train_size", "test_size", "seed")


# What --evaluate may take from the command line instead of the checkpoint.
QUIET_CHANGES = ("out_dir", "data_dir", "device", "workers", "loader", "timeout", "log_every", "checkpoint_every",
                 "keep_checkpoints", "stop_after_epoch", "evaluate", "compile", "tensorboard", "amp")


def reconcile_with_checkpoint(args, explicit: set, ckpt) -> list:
    """Check this run's flags against the checkpoint it continues, and return notes on what changed.

    Raises UserError if the data or the model differ: resuming would mix two runs. --evaluate takes
    every flag it was not given from the checkpoint, so `--evaluate --out-dir D` is enough. A
    training run keeps the checkpoint's --micro-batch unless given one, so a resume on fewer GPUs
    keeps the per-GPU memory (and more accumulation steps keep the global batch)."""
    if ckpt is None:
        return []
    saved = ckpt["config"]
    if args.evaluate:
        for key, value in saved.items():
            if hasattr(args, key) and key not in explicit and key not in ("evaluate", "out_dir"):
                setattr(args, key, value)
    elif "micro_batch" not in explicit:
        # The checkpoint's per-rank memory: its micro-batch, or its whole per-rank batch if it had none.
        args.micro_batch = saved["micro_batch"] or saved["micro_batch_size"]
    model_flags = [k for k in ckpt["model_config"] if hasattr(args, k)]  # the flags build_model's shapes follow
    for key in DATA_FLAGS + tuple(model_flags):
        if key in saved and hasattr(args, key) and getattr(args, key) != saved[key]:
            flag = "--" + key.replace("_", "-")
            what = "data" if key in DATA_FLAGS else "model"
            raise UserError(f"{flag} {getattr(args, key)} differs from the {saved[key]} of the checkpoint in "
                            f"{args.out_dir}, which trained other {what}: use another --out-dir for a new run, or "
                            f"{flag} {saved[key]} to continue it")
    if args.evaluate:
        return []
    changed = [f"--{k.replace('_', '-')} {saved[k]} -> {v}" for k, v in vars(args).items()
               if k in saved and k not in QUIET_CHANGES + DATA_FLAGS + tuple(model_flags) and saved[k] != v
               and (k != "micro_batch" or k in explicit)]  # a kept per-rank memory cap is no change
    return ["resumed with changes: " + ", ".join(changed)] if changed else []


def check_same_device(ckpt, path: str, device: torch.device, evaluate_only: bool) -> None:
    """Raise UserError if this run would continue `ckpt` on another device type."""
    trained_on = ckpt["config"]["device_type"] if ckpt is not None else device.type
    if trained_on != device.type and not evaluate_only:  # optimizer state and RNGs belong to the device type
        raise UserError(f"{path} was trained on {trained_on}, and this run is on {device.type}: resume with "
                        f"--device {trained_on}, or train afresh in another --out-dir")


def describe_shape(shape: dict) -> str:
    classes = f" of {shape['num_classes']} classes" if "num_classes" in shape else ""
    return f"{shape['channels']} x {shape['height']} x {shape['width']} images{classes}"


# --------------------------------------------------------------- the tools' SIGTERM and Ctrl-C
# bench.py, preflight.py and plot.py stop at once on SIGTERM (a timeout, scancel, torchrun) and Ctrl-C,
# in one line. (train_ddp.py instead turns them into a checkpointed stop: StopRequest.)


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM (timeout, scancel, torchrun) or SIGINT (Ctrl-C), raised in the main thread."""


_stop = {"signum": None, "lock": threading.Lock()}


def catch_stop_signals(grace_s: float = 1.5) -> None:
    """SIGTERM and SIGINT raise StoppedBySignal in the main thread at its next Python instruction; once it (or whatever
    it became on the way out) leaves the script, sys.excepthook ends the process with one line and exit status
    128 + signum (exit_stopped), after the `finally` blocks on the way (the process group, the DataLoader
    workers). A thread woken by the signal itself (signal.set_wakeup_fd) ends it the same way after `grace_s`
    if the main thread is held up, e.g. in a C call that waits for a peer which has already left. Forked
    processes (DataLoader workers) get the default handling back."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def on_signal(signum, frame):
        if _stop["signum"] is None:  # a second signal changes nothing: the thread below ends the process
            _stop["signum"] = signum
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # no DataLoader "worker killed" error on the way out
            raise StoppedBySignal(signum)

    def backstop():
        while not (got := [s for s in os.read(read_fd, 64) if s in (signal.SIGTERM, signal.SIGINT)]):
            pass
        time.sleep(grace_s)
        exit_stopped(got[0], flush=False)  # the main thread may hold stdout's lock

    def in_child():
        with contextlib.suppress(ValueError):  # raised if not the main thread
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def excepthook(kind, value, tb, default=sys.excepthook):
        if _stop["signum"] is not None:
            exit_stopped(_stop["signum"])
        default(kind, value, tb)

    def unraisable(info, default=sys.unraisablehook):  # a signal that lands in a __del__ is lost: the thread ends it
        if not isinstance(info.exc_value, StoppedBySignal):
            default(info)

    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    sys.excepthook, sys.unraisablehook = excepthook, unraisable
    os.register_at_fork(after_in_child=in_child)
    threading.Thread(target=backstop, name="stop-backstop", daemon=True).start()


def exit_stopped(signum: int, flush: bool = True) -> None:
    """`script: [rank r: ]stopped by SIGTERM` on stderr, once, then exit 128 + signum at once."""
    with _stop["lock"]:  # the main thread or the backstop, whichever comes first; the other waits here for the exit
        for stream in (sys.stdout, sys.stderr) if flush else ():
            with contextlib.suppress(Exception):
                stream.flush()
        env = read_dist_env()
        rank = f"rank {env.rank}: " if env.world_size > 1 else ""
        os.write(2, f"{os.path.basename(sys.argv[0])}: {rank}stopped by {signal.Signals(signum).name}\n".encode())
        mp = sys.modules.get("multiprocessing")  # DataLoader workers still up would outlive this process by seconds
        children = mp.active_children() if mp else []
        for child in children:
            with contextlib.suppress(Exception):
                child.terminate()
        for child in children:  # gone before we are, so nothing of ours outlives the exit line
            with contextlib.suppress(Exception):
                child.join(timeout=1.0)
        os._exit(128 + signum)


# ------------------------------------------------------------------------------- records internals

def _say(text: str) -> None:
    """log() from a signal handler, where print is not safe: rank 0 writes `text` to stderr."""
    if read_dist_env().is_main:
        os.write(2, text.encode())


def run_record(config: dict, ranks: list) -> dict:
    """What a run ran on, for run.json: code version, library versions, devices, hosts, Slurm."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    cuda = torch.cuda.is_available()
    return {
        "config": config, "git_commit": commit, "git_dirty": dirty,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                     "cudnn": torch.backends.cudnn.version() if cuda else None},
        "world_size": len(ranks), "ranks": ranks,
        "slurm": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_") and "TOKEN" not in k},
        "start_time": now_iso(), "end_time": None,
    }


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
