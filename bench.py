"""Benchmark the recipe's training step, launched like training (plain python or torchrun).

    torchrun --standalone --nproc_per_node=4 bench.py --compile --compare-original   # GPUs
    python bench.py --cpu-checks                                                      # CPU, about 2 minutes

The headline (img/s global and per GPU, step time) times the recipe's own step: train_ddp.train_step
in the loop train_one_epoch runs (the sampler's step_split, the loss sums, the ranks' stop check every
10 steps), fed by the recipe's loader (dataset_utils.build_loaders), with its normalisation, a summing
loss, DDP with gradient_as_bucket_view and, with --compile, torch.compile. A change to the step shows
here. A second, separately instrumented run of the same step splits it into data, forward+backward,
optimizer and exposed communication. Also: MFU against the device's dense bf16/fp16 tensor-core peak,
peak memory, and the augmentation of a whole epoch; all of it, with the exact configuration, as JSON.
--compare-original times, on the same device in the same run, the original script's pipeline (the
train_ddp.py of the "PyTorch on Olivia" guide: PIL transforms in DataLoader workers, fp16 autocast,
no channels_last, no compile) and gives the ratio. GPU time is taken with CUDA events, CPU time with
the wall clock, after warm-up steps.

--cpu-checks needs no GPU and takes about two minutes on 2 cores: batched tensor augmentation against
the PIL per-sample path, per core, and the training loop's overhead against a bare loop, step by step in
interleaved rounds on one thread, timed in CPU time, with the spread and a decision against the 3%
target (--profile adds where the extra time goes). It runs WRN-10-1 at batch 64 unless --depth,
--widen-factor or --batch-size say otherwise.

SIGTERM (timeout, scancel, torchrun) and Ctrl-C stop it at once: one line on stderr, exit status
128 + the signal's number (143, 130).
"""
import argparse
import contextlib
import itertools
import math
import os
import platform
import re
import statistics
import sys
import time


import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dataset_utils as du
import train_ddp
import train_utils as utils
from model import WideResNet
from train_utils import UserError, log

# Dense (no sparsity) bf16/fp16 tensor-core peaks, FLOP/s, from NVIDIA's data sheets.
PEAK_FLOPS = {"H200": 989e12, "H100 SXM": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "A40": 150e12, "V100": 125e12}
# The model and batch: the recipe's, and the small ones --cpu-checks takes unless told otherwise.
SHAPE_DEFAULTS = {"depth": 16, "widen_factor": 8, "batch_size": 512}
CPU_CHECK_DEFAULTS = {"depth": 10, "widen_factor": 1, "batch_size": 64}
WARMUP_ROUNDS = 6  # untimed rounds of the loop-overhead check: one in each order


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None and "": those flags say in words what they default to."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, "") else super()._get_help_string(action)


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch size (default: 512; 64 with --cpu-checks)")
    p.add_argument("--depth", type=int, default=None, help="WideResNet depth (default: 16; 10 with --cpu-checks)")
    p.add_argument("--widen-factor", type=int, default=None, help="WideResNet width (default: 8; 1 with --cpu-checks)")
    p.add_argument("--micro-batch", type=int, default=None, help="as in train_ddp.py: at most this many samples per "
                   "forward/backward on a rank, by gradient accumulation (default: no cap)")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compile, cuDNN autotuning)")
    p.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto", help="as in train_ddp.py")
    p.add_argument("--loader", choices=["gpu", "torch"], default="gpu", help="our data path: on the device, or a DataLoader")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP gradient bucket size (DDP's default: 25)")
    p.add_argument("--static-graph", action="store_true", help="DDP static_graph=True (the same graph every step)")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank (the original script used 8)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="as in train_ddp.py")
    p.add_argument("--compare-original", action="store_true", help="also time the original script's pipeline (PIL "
                   "transforms in DataLoader workers, fp16, no channels_last, no compile), same device, same run")
    p.add_argument("--cpu-checks", action="store_true", help="augmentation per core, and the loop's overhead against "
                   "a bare loop (WRN-10-1, batch 64 unless given)")
    p.add_argument("--rounds", type=int, default=200,
                   help="--cpu-checks: rounds of the loop-overhead check, one step of each loop per round")
    p.add_argument("--profile", action="store_true", help="--cpu-checks: also profile a few steps of each loop "
                   "(torch.profiler) and print where their time goes")
    p.add_argument("--json", default="", help="write the results here (default: runs/bench/bench-<device>-<ws>x.json)")
    return p


def resolve_shape(args) -> None:
    """Fill in --depth, --widen-factor and --batch-size left unset: the recipe's, or --cpu-checks' small ones."""
    for name, value in (CPU_CHECK_DEFAULTS if args.cpu_checks else SHAPE_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


class Timer:
    """Elapsed seconds between marks: CUDA events on the GPU (no host sync), the wall clock on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b):
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        return f"{model} ({os.cpu_count()} cores)"
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def peak_flops(device, amp_dtype):
    if device.type != "cuda":
        return None, "no peak for CPUs: MFU not reported"
    if amp_dtype is None:
        return None, "MFU is reported against the bf16/fp16 peak, so only with --amp bf16 or fp16"
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS.items():
        if re.search(rf"\b{key}\b", name):  # "A40" must not match "RTX A4000"
            return flops, f"{key} dense bf16/fp16 tensor-core peak, {flops / 1e12:.0f} TFLOP/s"
    return None, f"unknown peak for {name}: MFU not reported"


def flops_per_image(model, device, amp_dtype, channels_last):
    """Forward + backward FLOPs of one image, counted by torch.utils.flop_counter."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn(8, 3, 32, 32, device=device)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            model(x).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 8


# ----------------------------------------------------------------------------- the recipe's step, timed

def loader_steps(loader):
    """Endless steps from the recipe's training loader, epoch after epoch, as train_one_epoch walks them:
    (images, labels, the step's samples, this rank's micro-batch sizes) from the sampler's step_split."""
    for epoch in itertools.count(1):
        loader.batch_sampler.set_epoch(epoch)
        position = 0
        for images, labels in loader:
            step_samples, micro_sizes = loader.batch_sampler.step_split(position)
            position += step_samples
            yield images, labels, step_samples, micro_sizes


class RecipeLoop:
    """train_one_epoch's loop body over a stream of steps: set the LR, train_ddp.train_step, add its loss sums
    to the epoch's, and every STOP_CHECK_EVERY steps the ranks' stop check. Left out: the progress line (a
    loss read every --log-every steps, right after a stop check) and checkpoints. With `marks`, a timer mark
    is appended before each step's batch is drawn (MarkedNormalize and MarkedScaler add the others)."""

    def __init__(self, model, steps, *, normalize, optimizer, scaler, loss_fn, amp_dtype, device, marks=None,
                 timer=None, lr=0.01):
        self.model, self.steps, self.optimizer, self.lr = model, steps, optimizer, lr
        self.kwargs = dict(normalize=normalize, optimizer=optimizer, scaler=scaler, loss_fn=loss_fn,
                           amp_dtype=amp_dtype)
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.step, self.marks, self.timer = 0, marks, timer
        self.stop = utils.StopRequest()  # its check alone: outside a `with`, it installs no signal handlers

    def run(self, n: int) -> None:
        for _ in range(n):
            if self.marks is not None:
                self.marks.append(self.timer.mark())
            images, labels, step_samples, micro_sizes = next(self.steps)
            utils.set_lr(self.optimizer, self.lr)
            self.sums += train_ddp.train_step(self.model, images, labels, micro_sizes=micro_sizes,
                                              step_samples=step_samples, **self.kwargs)
            self.step += 1
            if self.step % utils.STOP_CHECK_EVERY == 0:
                self.stop.check(self.sums.device, self.sums, False)  # the ranks' all-reduce, read on the host


class MarkedNormalize:
    """train_step's normalisation with a timer mark after it: where its data phase ends."""

    def __init__(self, normalize, timer, marks):
        self.inner, self.scale, self.timer, self.marks = normalize, normalize.scale, timer, marks

    def __call__(self, images):
        out = self.inner(images)
        self.marks.append(self.timer.mark())
        return out


class MarkedScaler:
    """train_step's grad scaler with timer marks before its step (forward and backward done) and after its
    update (the optimizer step done)."""

    def __init__(self, scaler, timer, marks):
        self.inner, self.timer, self.marks = scaler, timer, marks

    def scale(self, loss):
        return self.inner.scale(loss)

    def step(self, optimizer):
        self.marks.append(self.timer.mark())
        return self.inner.step(optimizer)

    def update(self):
        self.inner.update()
        self.marks.append(self.timer.mark())


def time_recipe(loop: RecipeLoop, timer: Timer, steps: int, warmup: int) -> float:
    """Seconds per step of `loop`, after `warmup` untimed steps."""
    loop.run(warmup)
    start = timer.mark()
    loop.run(steps)
    return timer.seconds(start, timer.mark()) / steps


def time_phases(model, loader, normalize, optimizer, scaler, loss_fn, amp_dtype, device, steps, warmup) -> dict:
    """The same recipe step, run separately with timer marks between its phases: data (the loader's batch,
    the step split, the copy and normalisation), forward+backward (all micro-batches, the loss sums), optimizer
    (the scaler's step and update). Their sum leaves out the stop check every STOP_CHECK_EVERY steps."""
    timer, marks = Timer(device), []
    with contextlib.closing(loader_steps(loader)) as stream:
        loop = RecipeLoop(model, stream, normalize=MarkedNormalize(normalize, timer, marks), optimizer=optimizer,
                          scaler=MarkedScaler(scaler, timer, marks), loss_fn=loss_fn, amp_dtype=amp_dtype,
                          device=device, marks=marks, timer=timer)
        loop.run(warmup + steps)
    per_step = [marks[i:i + 4] for i in range(4 * warmup, len(marks), 4)]
    phases = [statistics.mean(timer.seconds(m[k], m[k + 1]) for m in per_step) for k in range(3)]
    return dict(zip(("data_s", "fwd_bwd_s", "optimizer_s"), phases))


def build(args, env, device, channels_last, compile_model, fused):
    """The model as the recipe builds it (to_device: channels_last on CUDA), its SGD, and the DDP wrapping and
    compile of train(). Returns (bare model, model to train, optimizer)."""
    torch.manual_seed(0)
    model = WideResNet(args.depth, args.widen_factor, du.CIFAR100_CLASSES)
    model = utils.to_device(model, device) if channels_last else model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, fused=fused)
    ddp = DDP(model, device_ids=[env.local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True,
              bucket_cap_mb=args.bucket_cap_mb, static_graph=args.static_graph) if dist.is_initialized() else model
    return model, (torch.compile(ddp, dynamic=False) if compile_model else ddp), optimizer


def bench_ours(args, env, device, amp_dtype, data):
    per_rank = args.batch_size // env.world_size
    cuda = device.type == "cuda"
    if args.batch_size < 1 or args.batch_size % env.world_size:
        raise UserError(f"--batch-size {args.batch_size} must be a positive multiple of the world size {env.world_size}")
    accum = utils.accumulation_steps(per_rank, args.micro_batch)
    bare, model, optimizer = build(args, env, device, channels_last=cuda, compile_model=args.compile, fused=cuda)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")  # the recipe's: train_step divides by the step's samples
    # A whole number of steps per epoch, so that every timed step is a full one (and compile sees one shape).
    n = len(data.labels) // args.batch_size * args.batch_size
    if n == 0:
        raise UserError(f"--batch-size {args.batch_size} exceeds the {len(data.labels)} training images")
    train = du.ImageData(data.images[:n], data.labels[:n])
    test = du.ImageData(data.images[:10_000], data.labels[:10_000])  # CIFAR-100's test set size
    loader, _ = du.build_loaders(train, test, batch_size=args.batch_size, rank=env.rank, world_size=env.world_size,
                                 accum_steps=accum, eval_batch=per_rank, seed=0, workers=args.workers, pin_memory=cuda,
                                 device=device if args.loader == "gpu" else None)
    normalize = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, device, channels_last=cuda)
    log(f"timing the recipe's step: WRN-{args.depth}-{args.widen_factor}, batch {args.batch_size} over "
        f"{env.world_size} {device.type} process(es){f' in {accum} micro-batches' if accum > 1 else ''}, "
        f"{args.steps} steps after {args.warmup} warm-up")
    timer = Timer(device)
    with contextlib.closing(loader_steps(loader)) as stream:
        loop = RecipeLoop(model, stream, normalize=normalize, optimizer=optimizer, scaler=scaler, loss_fn=loss_fn,
                          amp_dtype=amp_dtype, device=device)
        step_s = time_recipe(loop, timer, args.steps, args.warmup)
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None  # training, data included
    phase_steps = max(10, args.steps // 2)
    timing = (loader, normalize, optimizer, scaler, loss_fn, amp_dtype, device, phase_steps, 3)
    phases = time_phases(model, *timing)
    phases["exposed_comm_s"] = None
    if env.world_size > 1 and not args.compile:  # DDP minus no_sync: the communication not hidden by backward
        with model.no_sync():
            phases["exposed_comm_s"] = max(0.0, phases["fwd_bwd_s"] - time_phases(model, *timing)["fwd_bwd_s"])
    phases.update(steps=phase_steps, what="a separate run of the same step with timer marks between its phases "
                  "(data: batch, split, copy, normalisation; fwd_bwd: all micro-batches and the loss sums; optimizer: "
                  "the scaler's step and update; exposed_comm: fwd_bwd with DDP minus fwd_bwd under no_sync)")
    flops = flops_per_image(bare, device, amp_dtype, cuda)
    # One full epoch of augmentation on one device (all 50,000 images, this rank's batch size).
    everything, _ = du.build_loaders(data, test, batch_size=per_rank, rank=0, world_size=1, accum_steps=1,
                                     eval_batch=per_rank, seed=0, workers=0, pin_memory=False, device=device)
    everything.batch_sampler.set_epoch(1)
    for _ in everything:  # warm-up
        break
    t0 = timer.mark()
    for _ in everything:
        pass
    aug_epoch_s = timer.seconds(t0, timer.mark())
    return {"step_s": step_s, "what": "train_ddp.train_step in the recipe's loop (RecipeLoop), the recipe's loader",
            "steps": args.steps, "warmup": args.warmup, "accum_steps": accum, "phases": phases,
            "augment_epoch_s": aug_epoch_s, "augment_epoch_images": len(data.labels), "flops_per_image": flops,
            "peak_memory_gib": peak_memory}


# ----------------------------------------------------------------------------- the original script's pipeline

def original_transform():
    """The original script's per-sample training transform on PIL images."""
    import torchvision.transforms as T
    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD)])


class PILSet(torch.utils.data.Dataset):
    """The training images as torchvision's CIFAR100 serves them: PIL images through `transform`."""

    def __init__(self, data, transform):
        self.images = data.images.permute(0, 2, 3, 1).numpy()  # HWC uint8
        self.labels, self.transform = data.labels, transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        from PIL import Image
        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def original_batches(data, per_rank_batch, env, workers, device):
    """The original script's input pipeline: PIL images through torchvision transforms in DataLoader workers.
    Closing the generator shuts the workers down."""
    from torch.utils.data import DataLoader, DistributedSampler
    dataset = PILSet(data, original_transform())
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank)
    loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda", persistent_workers=workers > 0, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for images, labels in loader:
            yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def original_steps(model, batches, optimizer, scaler, amp_dtype, device, steps, warmup) -> float:
    """The original script's training loop (a mean loss, no loss bookkeeping); seconds per step after warm-up."""
    timer, loss_fn = Timer(device), nn.CrossEntropyLoss()
    model.train()
    start = None
    for i in range(warmup + steps):
        if i == warmup:
            start = timer.mark()
        images, labels = next(batches)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return timer.seconds(start, timer.mark()) / steps


def bench_original(args, env, device, data):
    per_rank = args.batch_size // env.world_size
    _, model, optimizer = build(args, env, device, channels_last=False, compile_model=False, fused=False)
    amp = torch.float16 if device.type == "cuda" else None  # the original: fp16 autocast on CUDA
    scaler = torch.amp.GradScaler(device.type, enabled=amp is not None)
    log(f"timing the original script's pipeline: {args.workers} DataLoader workers per rank, {args.steps} steps "
        f"after {args.warmup} warm-up")
    with contextlib.closing(original_batches(data, per_rank, env, args.workers, device)) as batches:
        step_s = original_steps(model, batches, optimizer, scaler, amp, device, args.steps, args.warmup)
    return {"step_s": step_s}


# ----------------------------------------------------------------------------- --cpu-checks

def augmentation_check(rounds: int = 5) -> dict:
    """Crop, flip and normalise per core: the PIL per-sample path against batched tensor ops, in
    interleaved rounds, in CPU time (one thread); the median rate of each."""
    from PIL import Image
    data = du.make_synthetic(4096, train=True)
    tf = original_transform()
    hwc = data.images.permute(0, 2, 3, 1).numpy()
    normalize = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, torch.device("cpu"))
    pad = du.crop_padding(*data.images.shape[-2:])
    padded = du.pad_images(data.images, pad)
    pil_rates, tensor_rates = [], []
    for rnd in range(rounds):
        t = time.process_time()
        for i in range(1024):
            tf(Image.fromarray(hwc[i]))
        pil_rates.append(1024 / (time.process_time() - t))
        t = time.process_time()
        for s in range(0, 4096, 512):
            idx = torch.arange(s, s + 512)
            normalize(du.crop_flip_batch(padded, idx, du.mix64(0, rnd, idx), pad))
        tensor_rates.append(4096 / (time.process_time() - t))
    aug = {"pil_img_per_s_per_core": statistics.median(pil_rates),
           "tensor_img_per_s_per_core": statistics.median(tensor_rates)}
    aug["speedup"] = aug["tensor_img_per_s_per_core"] / aug["pil_img_per_s_per_core"]
    return aug


def spread(values: list) -> dict:
    """Median, quartiles, range, and a distribution-free 95% confidence interval of the median (the order
    statistics the binomial distribution gives, as in a sign test)."""
    xs, n = sorted(values), len(values)
    q1, _, q3 = statistics.quantiles(xs, n=4) if n > 1 else (xs[0],) * 3
    cdf = itertools.accumulate(math.comb(n, i) / 2**n for i in range(n + 1))
    j = max(0, next(i for i, c in enumerate(cdf) if c > 0.025) - 1)  # P(fewer than j+1 values below the median) <= 2.5%
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1],
            "ci95": (xs[j], xs[n - 1 - j]), "n": n}


def pct(s: dict) -> str:
    lo, hi = s["ci95"]
    return (f"{s['median'] * 100:+.2f}% (95% CI of the median {lo * 100:+.2f} to {hi * 100:+.2f}%; quartiles "
            f"{s['q1'] * 100:+.2f} to {s['q3'] * 100:+.2f}%; range {s['min'] * 100:+.2f} to {s['max'] * 100:+.2f}%)")


class Identity:
    """A normalisation that leaves its input alone: train_step on batches normalised beforehand."""

    def __init__(self, device):
        self.scale = torch.ones((), device=device)

    def __call__(self, images):
        return images


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null for a while: the profiler's C++ side prints a line at every start and
    stop (USDT: profiler_start), whatever the log level."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def profile_loops(loops: dict, steps: int, rounds: int = 3) -> dict:
    """torch.profiler over `steps` steps of each loop, `rounds` times in turn: per op, its calls and self CPU
    time per step (ms)."""
    from torch.profiler import ProfilerActivity, profile
    tables = {name: {} for name in loops}
    for _ in range(rounds):
        for name, run in loops.items():
            with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
                run(steps)
            for e in prof.key_averages():
                calls, ms = tables[name].get(e.key, (0, 0.0))
                n = steps * rounds
                tables[name][e.key] = (calls + e.count / n, ms + e.self_cpu_time_total / 1e3 / n)
    return tables


def profile_differences(tables: dict, name: str) -> tuple:
    """What loop `name` runs beyond the bare loop: the ops the bare loop never calls, with their self CPU ms
    per step (largest first), and the ops both call but `name` more often, with the extra calls per step.
    The time of an op both call differs between the loops by the machine's noise as much as by their work."""
    bare, other = tables["bare"], tables[name]
    new = sorted(((ms, op) for op, (calls, ms) in other.items() if op not in bare), reverse=True)
    more = sorted(((calls - bare[op][0], op) for op, (calls, _) in other.items()
                   if op in bare and calls - bare[op][0] > 0.05), reverse=True)
    return [(op, ms) for ms, op in new], [(op, n) for n, op in more]


def decide(s: dict, target: float = 0.03) -> str:
    lo, hi = s["ci95"]
    return (f"at most {target:.0%}" if hi <= target else f"over {target:.0%}" if lo > target else
            f"undecided (its 95% interval holds {target:.0%}: run more --rounds)")


def loop_overhead_check(depth: int, width: int, batch: int, rounds: int, profile: bool) -> dict:
    """The training loop's overhead, on one thread. Each round runs one step of each of three loops, in an
    order that cycles through all six, on the same model and optimizer:
      bare: a minimal loop over ready-made normalised batches (mean loss, zero_grad, backward, step);
      step: the recipe's loop (RecipeLoop: train_step, its loss sums, the stop check) over the same batches,
        with its normalisation left out: the same work as bare, so the difference is the loop's bookkeeping;
      recipe: the recipe's loop end to end: the device loader (gather, crop, flip), normalisation, train_step.
    and then the data path alone (the device loader and normalisation). Steps are timed in this process's CPU
    time, which other processes on the same cores inflate far less than the wall clock, and compared within
    a round (loop / bare - 1), a fraction of a second apart, so that the machine's drifts cancel: the median
    of the rounds, with a 95% interval, says whether the overhead is within 3%. The first WARMUP_ROUNDS are
    not timed."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = WideResNet(depth, width, du.CIFAR100_CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    mean_loss, sum_loss = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")
    normalize = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, device)
    data = du.make_synthetic(batch * 16, train=True)
    loaders = [du.build_loaders(data, data, batch_size=batch, rank=0, world_size=1, accum_steps=1, eval_batch=batch,
                                seed=0, workers=0, pin_memory=False, device=device)[0] for _ in range(3)]
    loaders[0].batch_sampler.set_epoch(0)
    ready = [(normalize(x), y) for x, y in loaders[0]]  # the recipe's own batches, made beforehand
    bare_batches = itertools.cycle(ready)
    model.train()

    def bare_loop(n):
        for _ in range(n):
            images, labels = next(bare_batches)
            loss = mean_loss(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    common = dict(optimizer=optimizer, scaler=scaler, loss_fn=sum_loss, amp_dtype=None, device=device)
    step = RecipeLoop(model, ((x, y, batch, [batch]) for x, y in itertools.cycle(ready)), normalize=Identity(device),
                      **common)
    recipe = RecipeLoop(model, loader_steps(loaders[1]), normalize=normalize, **common)
    data_stream = loader_steps(loaders[2])

    def data_path(n):
        for _ in range(n):
            normalize(next(data_stream)[0])

    loops = {"bare": bare_loop, "step": step.run, "recipe": recipe.run, "data": data_path}
    orders = list(itertools.permutations(["bare", "step", "recipe"]))
    times = {name: [] for name in loops}
    for rnd in range(WARMUP_ROUNDS + rounds):
        for name in (*orders[rnd % len(orders)], "data"):
            t = time.process_time()
            loops[name](1)
            if rnd >= WARMUP_ROUNDS:
                times[name].append(time.process_time() - t)
    ratio = {name: spread([t / b - 1 for t, b in zip(times[name], times["bare"])]) for name in ("step", "recipe")}
    data_share = spread([t / b for t, b in zip(times["data"], times["bare"])])
    ms = {name: statistics.median(ts) for name, ts in times.items()}
    result = {"model": f"WRN-{depth}-{width}", "batch": batch, "threads": torch.get_num_threads(), "rounds": rounds,
              "clock": "process CPU time", "bare_step_s": ms["bare"], "step_step_s": ms["step"],
              "ours_step_s": ms["recipe"], "data_path_s": ms["data"], "bookkeeping": ratio["step"],
              "overhead": ratio["recipe"], "overhead_fraction": ratio["recipe"]["median"],
              "data_path_fraction": data_share["median"], "data_path_share": data_share,
              "decision": {"bookkeeping": decide(ratio["step"]), "end_to_end": decide(ratio["recipe"])},
              "per_round_s": times}
    if profile:
        result["profile"] = profile_loops({"bare": bare_loop, "step": step.run, "recipe": recipe.run}, 10)
    return result


def cpu_checks(args) -> dict:
    """Per-core comparisons that need no GPU, on one thread: with two or more, other processes on the same
    cores make OpenMP's threads wait for each other, and a step's time swings several-fold."""
    torch.set_num_threads(1)
    return {"augmentation": augmentation_check(),
            "loop_overhead": loop_overhead_check(args.depth, args.widen_factor, args.batch_size, args.rounds,
                                                 args.profile)}


def report_cpu_checks(c: dict, seconds: float) -> None:
    a, lo = c["augmentation"], c["loop_overhead"]
    log(f"augmentation, 1 core: PIL per sample {a['pil_img_per_s_per_core']:.0f} img/s, "
        f"batched tensor ops {a['tensor_img_per_s_per_core']:.0f} img/s: {a['speedup']:.1f}x")
    log(f"loop overhead ({lo['model']}, batch {lo['batch']}): {lo['ours_step_s'] * 1e3:.1f} ms/step vs "
        f"bare {lo['bare_step_s'] * 1e3:.1f} ms/step: {lo['overhead_fraction'] * 100:.1f}%; the data path "
        f"alone {lo['data_path_s'] * 1e3:.2f} ms/step, {lo['data_path_fraction'] * 100:.1f}% of the bare step "
        f"(medians of {lo['rounds']} rounds, one step of each loop per round, CPU time, {lo['threads']} thread)")
    log(f"  the recipe end to end (device loader, normalisation, train_step, loss sums, stop check) against the "
        f"bare loop over ready-made batches: {pct(lo['overhead'])}")
    log(f"  of which the step's bookkeeping (train_step and the loop on the bare loop's batches, same work): "
        f"{pct(lo['bookkeeping'])}")
    log(f"  decision (target: at most 3%): the loop's own overhead is {lo['decision']['bookkeeping']}; end to end, "
        f"with the data path, {lo['decision']['end_to_end']}")
    if "profile" in lo:
        prof = lo["profile"]
        log("  profile, self CPU ms per step (10 steps of each loop, 3 times in turn): " + "; ".join(
            f"{name} {sum(ms for _, ms in table.values()):.1f}" for name, table in prof.items()))
        for name in ("step", "recipe"):
            new, more = profile_differences(prof, name)
            log(f"  profile, {name} loop: ops the bare loop never calls, {sum(ms for _, ms in new):.2f} ms per step: "
                + ", ".join(f"{op} {ms:.3f}" for op, ms in new[:12]))
            log(f"  profile, {name} loop: ops the bare loop calls too, but fewer times (extra calls per step): "
                + ", ".join(f"{op} {n:+.1f}" for op, n in more[:12]))
    log(f"cpu checks took {seconds:.0f} s")


# ----------------------------------------------------------------------------- main

def main(args):
    resolve_shape(args)
    env = utils.read_dist_env()
    env.device = device = utils.pick_device(args.device, env.local_rank)
    utils.init_distributed(env, 600)  # sets this rank's GPU first
    amp_dtype = utils.resolve_amp(args.amp, device)
    torch.backends.cudnn.benchmark = True
    try:
        result = {"config": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                  else cpu_name(), "world_size": env.world_size, "torch": torch.__version__,
                  "amp_dtype": str(amp_dtype), "hosts": sorted(set(utils.all_gather(platform.node())))}
        if args.cpu_checks:
            if args.rounds < 1:
                raise UserError(f"--rounds must be at least 1, got {args.rounds}")
            log(f"cpu checks: WRN-{args.depth}-{args.widen_factor}, batch {args.batch_size}, {args.rounds} rounds "
                f"(about two minutes on 2 cores with the defaults)")
            t0 = time.perf_counter()
            result["cpu_checks"] = cpu_checks(args)
            report_cpu_checks(result["cpu_checks"], time.perf_counter() - t0)
        else:
            data = du.make_synthetic(50_000, train=True)  # CIFAR-100's training set size
            peak, peak_note = peak_flops(device, amp_dtype)
            ours = bench_ours(args, env, device, amp_dtype, data)
            ips = args.batch_size / ours["step_s"]
            ours.update(images_per_s=ips, images_per_s_per_gpu=ips / env.world_size,
                        mfu=ours["flops_per_image"] * ips / env.world_size / peak if peak else None,
                        peak_note=peak_note)
            result["ours"] = ours
            ms = lambda s: "n/a" if s is None else f"{s * 1e3:.2f} ms"  # noqa: E731
            ph = ours["phases"]
            log(f"ours: {ips:.0f} img/s, {ips / env.world_size:.0f} img/s per {device.type}, step {ms(ours['step_s'])} "
                f"(train_ddp.train_step in the recipe's loop)")
            log(f"ours, phases (a separate run of the same step, with timer marks between its phases): data "
                f"{ms(ph['data_s'])}, fwd+bwd {ms(ph['fwd_bwd_s'])}, optimizer {ms(ph['optimizer_s'])}, exposed comm "
                f"{ms(ph['exposed_comm_s'])}")
            log(f"augmentation of one {ours['augment_epoch_images']}-image epoch on one {device.type}: "
                f"{ours['augment_epoch_s'] * 1e3:.1f} ms")
            mfu = "n/a" if ours["mfu"] is None else f"{ours['mfu'] * 100:.1f}%"
            mem = "n/a" if ours["peak_memory_gib"] is None else f"{ours['peak_memory_gib']:.2f} GiB"
            log(f"MFU: {mfu} ({ours['flops_per_image'] / 1e9:.2f} GFLOP per image fwd+bwd; {peak_note}); "
                f"peak memory {mem}")
            if args.compare_original:
                original = bench_original(args, env, device, data)
                original["images_per_s"] = args.batch_size / original["step_s"]
                result["original"], result["speedup_vs_original"] = original, ips / original["images_per_s"]
                log(f"the original script's pipeline: {original['images_per_s']:.0f} img/s; ours is "
                    f"{result['speedup_vs_original']:.2f}x")
        name = f"bench-{''.join(c if c.isalnum() else '_' for c in result['device'])[:40]}-{env.world_size}x.json"
        path = args.json or os.path.join("runs", "bench", name)  # runs/ is git-ignored
        if env.is_main:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            utils.write_json(path, result)
            log(f"wrote {path}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    utils.catch_stop_signals()  # SIGTERM and Ctrl-C: out at once, in one line
    try:
        main(get_args_parser().parse_args())
    except UserError as e:
        log(f"error: {e}", file=sys.stderr)
        sys.exit(2)
