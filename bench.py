"""Benchmark the recipe's training loop, launched like training (plain python or torchrun).

    torchrun --standalone --nproc_per_node=4 bench.py --compile --compare-original   # GPUs
    python bench.py --cpu-checks                                                      # CPU, about 2 minutes

The headline (img/s global and per GPU, step time) times the recipe itself: train_ddp.train_one_epoch (the
LR, train_ddp.train_step, the loss sums, the ranks' stop check every 10 steps) over an epoch of --steps steps
after --warmup untimed ones, on what train_ddp.build_training makes from the recipe's own flags (this
script's model, batch and data-path flags over its parser's defaults): the model, SGD, grad scaler, summing
loss, loader and normalisation; in DDP with gradient_as_bucket_view and, with --compile, torch.compile, as
train() wraps them. A change to the recipe shows here. A second, separately instrumented run of the same
loop splits the step into data, forward+backward, optimizer and exposed communication. Also: MFU against
the device's dense bf16/fp16 tensor-core peak, peak memory, and the augmentation of a whole epoch; all of
it, with the exact configuration, as JSON. --compare-original times, on the same device in the same run, the
original script's pipeline (the train_ddp.py of the "PyTorch on Olivia" guide: PIL transforms in DataLoader
workers, fp16 autocast, no channels_last, no compile) and gives the ratio. GPU time is taken with CUDA
events, CPU time with the wall clock, after warm-up steps.

--cpu-checks needs no GPU and takes about two minutes on 2 cores: batched tensor augmentation against
the PIL per-sample path, per core, and the recipe's loop (train_one_epoch) against a bare loop, step by
step in interleaved rounds on one thread, timed in CPU time, with the spread and a decision against the 3%
target (--profile adds where the extra time goes). It runs WRN-10-1 at batch 64 unless --depth,
--widen-factor or --batch-size say otherwise.

SIGTERM (timeout, scancel, torchrun) and Ctrl-C stop it at once: one line on stderr, exit status
128 + the signal's number (143, 130).
"""
import argparse
import contextlib
import dataclasses
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
from machinery.errors import UserError, all_gather
from machinery.files import write_json
from machinery.output import log
from machinery.cli import run_tool
from model import depth_arg, width_arg

# Dense (no sparsity) bf16/fp16 tensor-core peaks, FLOP/s, from NVIDIA's data sheets.
PEAK_FLOPS = {"H200": 989e12, "H100 SXM": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "A40": 150e12, "V100": 125e12}
# The model and batch: the recipe's, and the small ones --cpu-checks takes unless told otherwise.
SHAPE_DEFAULTS = {"depth": 16, "widen_factor": 8, "batch_size": 512}
CPU_CHECK_DEFAULTS = {"depth": 10, "widen_factor": 1, "batch_size": 64}
WARMUP_ROUNDS = 24  # untimed rounds of the loop-overhead check: one in each order of its four loops


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None and "": those flags say in words what they default to."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, "") else super()._get_help_string(action)


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch size (default: 512; 64 with --cpu-checks)")
    p.add_argument("--depth", type=depth_arg, default=None, help="WRN depth, 6n+4 (default: 16; 10 with --cpu-checks)")
    p.add_argument("--widen-factor", type=width_arg, default=None, help="WRN width (default: 8; 1 with --cpu-checks)")
    p.add_argument("--micro-batch", type=int, default=None, help="as in train_ddp.py: at most this many samples per "
                   "forward/backward on a rank, by gradient accumulation (default: no cap)")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compile, cuDNN autotuning)")
    p.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto", help="as in train_ddp.py")
    p.add_argument("--loader", choices=["gpu", "torch"], default="gpu",
                   help="our data path: on the device, or a DataLoader")
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
    p.add_argument("--augment-share", action="store_true", help="the modern recipe's augmentation (TrivialAugment, "
                   "random erasing, mixup/cutmix): the step with and without it, and its loader alone, on both loaders")
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


# ----------------------------------------------------------------------------- the recipe's loop, timed

def recipe_config(args, env, **flags) -> utils.RunConfig:
    """The recipe's config (utils.make_config, a collective) from its own parser's defaults under this script's
    model, batch and data-path flags, and `flags`; the flags checked as train_ddp.py checks them."""
    recipe = train_ddp.get_args_parser().parse_args([])
    mapped = ("depth", "widen_factor", "batch_size", "micro_batch", "amp", "loader", "workers", "device", "compile")
    vars(recipe).update({"dataset": "synthetic", **{name: getattr(args, name) for name in mapped}, **flags})
    utils.check_args(recipe, env.world_size, env.device)
    return utils.make_config(recipe, env)


def wrap(model, args, env, compile_model: bool, step_log=None):
    """train()'s DDP wrapping and compile, with this script's DDP bucket size and static graph; `step_log`: the
    utils.StepLog that times DDP's all-reduce, as train() has it (None: DDP's own C++ all-reduce, no hook)."""
    if env.distributed:
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                    gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb, static_graph=args.static_graph,
                    **utils.NO_FORWARD_BUFFER_SYNC)
        if step_log is not None:
            step_log.watch_ddp(model)
    return torch.compile(model, dynamic=False) if compile_model else model


class TrainSteps:
    """N steps of the recipe's own loop, train_ddp.train_one_epoch, on `training`: each call of it enters an epoch
    where no more steps are left than are still to run (as a resumed run enters it), and the step count runs on
    from call to call (a stop check every STOP_CHECK_EVERY steps, as in one long run). Also the loop's
    checkpoint, which saves nothing (cfg.checkpoint_every is 0)."""

    def __init__(self, model, training, cfg, *, stop=None, step_log=None):
        self.model, self.training, self.cfg = model, training, cfg
        self.per_epoch = training.train_loader.batch_sampler.num_samples // cfg.batch_size
        self.stop = stop or utils.StopRequest()  # outside a `with`, it installs no signal handlers
        # The recipe's: no progress lines (0), each step's phases timed, as in training.
        self.step_log = step_log or utils.StepLog(0, training.normalize.scale.device)
        self.steps = self.epoch = 0

    def run(self, n: int) -> None:
        while n > 0:
            k, self.epoch = min(n, self.per_epoch), self.epoch + 1
            progress = utils.Progress(position=(self.per_epoch - k) * self.cfg.batch_size, step=self.steps)
            if train_ddp.train_one_epoch(self.model, self.training, cfg=self.cfg, epoch=self.epoch, progress=progress,
                                         stop=self.stop, checkpoint=self, step_log=self.step_log):
                raise UserError(f"stop requested ({self.stop.reason}): the benchmark ends unfinished")
            self.steps, n = self.steps + k, n - k

    def save(self, progress) -> None:
        pass


class Marked:
    """`inner` (the Training's normalisation or scaler, the loop's stop check or progress log) with a timer mark,
    named after the phase it ends, before or after each call of the methods named. Other attributes: inner's."""

    def __init__(self, inner, mark, *, before=(), after=()):
        self.inner, self.mark, self.before, self.after = inner, mark, dict(before), dict(after)

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name not in self.before and name not in self.after:
            return method

        def marked(*args, **kwargs):
            self.mark(self.before.get(name))
            out = method(*args, **kwargs)
            self.mark(self.after.get(name))
            return out
        return marked

    def __call__(self, *args, **kwargs):
        return self.__getattr__("__call__")(*args, **kwargs)


def time_phases(model, training, cfg, steps: int, warmup: int = 3) -> dict:
    """The recipe's loop, run separately with timer marks between the phases of each step: data (from the end of
    the previous step: the LR, the loader's batch, the step split, the copy and normalisation), forward+backward
    (all micro-batches, the loss sums), optimizer (the scaler's step and update). Left out: the stop check every
    STOP_CHECK_EVERY steps, and an epoch's start and end (the data phase of an epoch's first step)."""
    timer, marks = Timer(training.normalize.scale.device), []

    def mark(what):  # what: the phase that ends here, or None
        if what:
            marks.append((what, timer.mark()))
    marked = dataclasses.replace(training, normalize=Marked(training.normalize, mark, after={"__call__": "data"}),
                                 scaler=Marked(training.scaler, mark, before={"step": "fwd_bwd"},
                                               after={"update": "optimizer"}))
    loop = TrainSteps(model, marked, cfg, stop=Marked(utils.StopRequest(), mark, after={"check": "stop check"}),
                      step_log=Marked(utils.StepLog(0, training.normalize.scale.device), mark,
                                      after={"update": "step", "start": "epoch"}))
    loop.run(warmup)
    marks.clear()
    loop.run(steps)
    phases = {"data": [], "fwd_bwd": [], "optimizer": []}
    for (before, a), (what, b) in zip(marks, marks[1:]):
        if what in phases and (what != "data" or before in ("step", "stop check")):
            phases[what].append(timer.seconds(a, b))
    return {f"{name}_s": statistics.mean(s) if s else None for name, s in phases.items()}


def bench_data(args, cfg, env, data: du.ImageData) -> du.CheckedData:
    """The data as build_training takes them: --steps whole steps of training images (one timed epoch; fewer if
    `data` holds fewer; whole, so that compile sees one shape), and test images (unused), measured."""
    n = min(args.steps, len(data) // args.batch_size) * args.batch_size
    if n == 0:
        raise UserError(f"--batch-size {args.batch_size} exceeds the {len(data)} training images")
    train, test = (dataclasses.replace(data, images=data.images[:k], labels=data.labels[:k]) for k in (n, 10_000))
    return du.CheckedData(train, test, du.measure_data(train, test), {}, du.data_device(cfg.loader, env.device,
                                                                                        train, test))


def bench_ours(args, env, cfg, checked: du.CheckedData, data: du.ImageData) -> dict:
    device, accum, cuda = env.device, cfg.accumulation_steps, env.device.type == "cuda"
    training = train_ddp.build_training(cfg, env, checked)
    step_log = utils.StepLog(0, device)  # the recipe's: each step's phases timed, DDP's all-reduce through its hook
    model = wrap(training.model, args, env, args.compile, step_log=step_log)
    log(f"timing the recipe's step: WRN-{cfg.depth}-{cfg.widen_factor}, batch {cfg.batch_size} over "
        f"{env.world_size} {device.type} process(es){f' in {accum} micro-batches' if accum > 1 else ''}, "
        f"{args.steps} steps after {args.warmup} warm-up")
    timer, loop = Timer(device), TrainSteps(model, training, cfg, step_log=step_log)
    loop.run(args.warmup)
    log("warm-up done: the timed steps begin")
    start = timer.mark()
    loop.run(args.steps)
    step_s = timer.seconds(start, timer.mark()) / args.steps
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None  # training, data included
    phase_steps = max(10, args.steps // 2)
    phases = time_phases(model, training, cfg, phase_steps)
    phases["exposed_comm_s"] = None
    if env.world_size > 1 and not args.compile:  # DDP minus no_sync: the communication not hidden by backward
        with model.no_sync():
            phases["exposed_comm_s"] = max(0.0, phases["fwd_bwd_s"] - time_phases(model, training, cfg,
                                                                                  phase_steps)["fwd_bwd_s"])
    phases.update(steps=phase_steps, what="a separate run of the recipe's loop with timer marks between the phases "
                  "of each step (data: LR, batch, split, copy, normalisation; fwd_bwd: all micro-batches and the loss "
                  "sums; optimizer: the scaler's step and update; exposed_comm: fwd_bwd with DDP minus fwd_bwd under "
                  "no_sync); left out: the stop check every 10 steps, and an epoch's start and end")
    flops = flops_per_image(training.model, device, cfg.amp_dtype, cuda)
    # One full epoch of augmentation on one device (all 50,000 images, this rank's batch size).
    everything, _ = du.build_loaders(data, checked.test, batch_size=cfg.per_rank_batch, rank=0, world_size=1,
                                     accum_steps=1, eval_batch=cfg.per_rank_batch, seed=0, workers=0,
                                     pin_memory=False, device=device)
    everything.batch_sampler.set_epoch(1)
    next(iter(everything))  # warm-up
    t0 = timer.mark()
    for _ in everything:
        pass
    aug_epoch_s = timer.seconds(t0, timer.mark())
    return {"step_s": step_s, "what": "train_ddp.train_one_epoch on build_training's Training: an epoch of `steps` "
            "steps, its start and end included (several epochs past 50,000 images), after `warmup` untimed steps",
            "steps": args.steps, "warmup": args.warmup, "accum_steps": accum, "phases": phases,
            "augment_epoch_s": aug_epoch_s, "augment_epoch_images": len(data.labels), "flops_per_image": flops,
            "peak_memory_gib": peak_memory}


# ----------------------------------------------------------------------------- the modern recipe's augmentation

MODERN_AUGMENT = dict(auto_augment="ta_wide", random_erase=0.25, mixup_alpha=0.2, cutmix_alpha=1.0)


def augment_share(args, env, data: du.ImageData) -> dict:
    """On each loader (the device's, and DataLoader workers), the recipe's step (train_one_epoch) with and without
    MODERN_AUGMENT, --steps after --warmup, and the loader alone over the same steps (its batches, no training):
    the augmentation's cost per step, and its share of the step with it."""
    timer, rows = Timer(env.device), {}
    for loader in ("gpu", "torch"):
        row = {}
        for name, flags in (("plain", {}), ("modern", MODERN_AUGMENT)):
            cfg = recipe_config(args, env, loader=loader, **flags)
            checked = bench_data(args, cfg, env, data)
            training = train_ddp.build_training(cfg, env, checked)
            loop = TrainSteps(wrap(training.model, args, env, args.compile), training, cfg)
            loop.run(args.warmup)
            start = timer.mark()
            loop.run(args.steps)
            step_s = timer.seconds(start, timer.mark()) / args.steps
            batches = training.train_loader
            batches.batch_sampler.set_epoch(1)
            start, n = timer.mark(), 0
            for images, labels in batches:
                images.to(env.device, non_blocking=True), labels.to(env.device, non_blocking=True)
                n += 1
            row[name] = {"step_s": step_s, "loader_s": timer.seconds(start, timer.mark()) / max(n, 1)}
        modern, plain = row["modern"], row["plain"]
        row["augment_s"] = modern["loader_s"] - plain["loader_s"]  # the loader's extra time per step
        row["augment_share"] = row["augment_s"] / modern["step_s"]
        row["step_ratio"] = modern["step_s"] / plain["step_s"]
        rows[loader] = row
        log(f"--loader {loader}: step {plain['step_s'] * 1e3:.1f} ms plain, {modern['step_s'] * 1e3:.1f} ms with "
            f"the modern augmentation ({row['step_ratio']:.2f}x); its loader alone {plain['loader_s'] * 1e3:.1f} -> "
            f"{modern['loader_s'] * 1e3:.1f} ms a step: the augmentation is {row['augment_share'] * 100:.1f}% of "
            f"the step")
    return {"augment": MODERN_AUGMENT, "what": "per step: the recipe's train_one_epoch with and without the "
            "augmentation, and the training loader alone (its batches copied to the device, no training); "
            "augment_share: the loader's extra time over the step with it (on GPUs the device loader's ops queue "
            "behind the step, so the step ratio is the cost that counts)", **rows}


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


def bench_original(args, env, cfg, data, checked) -> dict:
    device, per_rank = env.device, args.batch_size // env.world_size
    # The recipe's model and SGD (build_training; its loaders never started), as the original script had them:
    # the weights not channels_last, and SGD's default implementation, not the fused one (the same on CPU).
    training = train_ddp.build_training(cfg, env, dataclasses.replace(checked, train=None, device=None))
    model = wrap(training.model.to(memory_format=torch.contiguous_format), args, env, compile_model=False)
    for group in training.optimizer.param_groups:
        group["fused"] = None
    amp = torch.float16 if device.type == "cuda" else None  # the original: fp16 autocast on CUDA
    scaler = torch.amp.GradScaler(device.type, enabled=amp is not None)
    log(f"timing the original script's pipeline: {args.workers} DataLoader workers per rank, {args.steps} steps "
        f"after {args.warmup} warm-up")
    with contextlib.closing(original_batches(data, per_rank, env, args.workers, device)) as batches:
        step_s = original_steps(model, batches, training.optimizer, scaler, amp, device, args.steps, args.warmup)
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


class ReadyLoader:
    """A training loader of one step per epoch: batches made beforehand, in turn."""

    def __init__(self, batches, batch_size: int):
        self.batches = itertools.cycle(batches)
        self.batch_sampler = du.EpochSampler(batch_size, batch_size=batch_size, rank=0, world_size=1)

    def __iter__(self):
        return iter([next(self.batches)])

    def step_split(self, position: int) -> tuple:
        return self.batch_sampler.step_split(position)

    def check(self) -> None:
        pass  # ready-made batches: nothing unreadable to agree on


def loop_overhead_check(args, cfg, env) -> dict:
    """The training loop's overhead, on one thread. Each round runs one step of each of three loops, in an
    order that cycles through all six, on the same model and optimizer (build_training's, for `cfg`):
      bare: a minimal loop over ready-made normalised batches (mean loss, zero_grad, backward, step);
      step: the recipe's loop (train_one_epoch: the LR, train_step, its loss sums, the stop check) over the same
        batches, with its normalisation left out: the same work as bare, so the difference is the loop's bookkeeping;
      recipe: the recipe's loop end to end: the device loader (gather, crop, flip), normalisation, train_step.
    and then the data path alone (the device loader and normalisation). A step of the recipe's loop is a whole
    epoch of it, so its work per epoch (the epoch's order and sums) counts in every step: an upper bound. Steps
    are timed in this process's CPU time, which other processes on the same cores inflate far less than the wall
    clock, and compared within a round (loop / bare - 1), a fraction of a second apart, so that the machine's
    drifts cancel: the median of the rounds, with a 95% interval, says whether the overhead is within 3%. The
    first WARMUP_ROUNDS are not timed."""
    data = du.make_synthetic(cfg.batch_size, train=True)  # an epoch of one step
    training = train_ddp.build_training(cfg, env, du.CheckedData(data, data, du.measure_data(data, data), {},
                                                                 env.device))  # the device loader, on the CPU
    model, optimizer, loader, normalize = training.model, training.optimizer, training.train_loader, training.normalize

    def batches(epoch):  # the recipe's normalised batches of an epoch (of one step)
        loader.batch_sampler.set_epoch(epoch)
        return [(normalize(x), y) for x, y in loader]
    ready = [batch for epoch in range(16) for batch in batches(epoch)]  # made beforehand
    bare_batches, mean_loss = itertools.cycle(ready), nn.CrossEntropyLoss()
    model.train()

    def bare_loop(n):
        for _ in range(n):
            images, labels = next(bare_batches)
            loss = mean_loss(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    identity = nn.Identity()  # a normalisation that leaves the batches normalised beforehand alone
    identity.scale = normalize.scale  # where train_step reads the device
    step = TrainSteps(model, dataclasses.replace(training, normalize=identity,
                                                 train_loader=ReadyLoader(ready, cfg.batch_size)), cfg)
    recipe = TrainSteps(model, training, cfg)
    untimed = TrainSteps(model, training, cfg, step_log=utils.StepLog(0, normalize.scale.device, timed=False))

    def data_path(n):
        for epoch in range(n):
            batches(epoch)

    loops = {"bare": bare_loop, "step": step.run, "recipe": recipe.run, "untimed": untimed.run, "data": data_path}
    orders = list(itertools.permutations(["bare", "step", "recipe", "untimed"]))
    times = {name: [] for name in loops}
    for rnd in range(WARMUP_ROUNDS + args.rounds):
        for name in (*orders[rnd % len(orders)], "data"):
            t = time.process_time()
            loops[name](1)
            if rnd >= WARMUP_ROUNDS:
                times[name].append(time.process_time() - t)
    ratio = {name: spread([t / b - 1 for t, b in zip(times[name], times["bare"])]) for name in ("step", "recipe")}
    # The cost of the recipe's per-step timing (StepLog's marks): the recipe's loop against itself untimed.
    ratio["timing"] = spread([t / u - 1 for t, u in zip(times["recipe"], times["untimed"])])
    data_share = spread([t / b for t, b in zip(times["data"], times["bare"])])
    ms = {name: statistics.median(ts) for name, ts in times.items()}
    result = {"model": f"WRN-{cfg.depth}-{cfg.widen_factor}", "batch": cfg.batch_size, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "clock": "process CPU time", "bare_step_s": ms["bare"],
              "step_step_s": ms["step"], "ours_step_s": ms["recipe"], "data_path_s": ms["data"],
              "untimed_step_s": ms["untimed"], "timing_cost": ratio["timing"],
              "bookkeeping": ratio["step"], "overhead": ratio["recipe"], "overhead_fraction": ratio["recipe"]["median"],
              "data_path_fraction": data_share["median"], "data_path_share": data_share,
              "decision": {"bookkeeping": decide(ratio["step"]), "end_to_end": decide(ratio["recipe"]),
                           "timing": decide(ratio["timing"], target=0.01)},
              "per_round_s": times}
    if args.profile:
        result["profile"] = profile_loops({"bare": bare_loop, "step": step.run, "recipe": recipe.run}, 10)
    return result


def cpu_checks(args, cfg, env) -> dict:
    """Per-core comparisons that need no GPU, on one thread: with two or more, other processes on the same
    cores make OpenMP's threads wait for each other, and a step's time swings several-fold."""
    torch.set_num_threads(1)
    return {"augmentation": augmentation_check(), "loop_overhead": loop_overhead_check(args, cfg, env)}


def report_cpu_checks(c: dict, seconds: float) -> None:
    a, lo = c["augmentation"], c["loop_overhead"]
    log(f"augmentation, 1 core: PIL per sample {a['pil_img_per_s_per_core']:.0f} img/s, "
        f"batched tensor ops {a['tensor_img_per_s_per_core']:.0f} img/s: {a['speedup']:.1f}x")
    log(f"loop overhead ({lo['model']}, batch {lo['batch']}): {lo['ours_step_s'] * 1e3:.1f} ms/step vs "
        f"bare {lo['bare_step_s'] * 1e3:.1f} ms/step: {lo['overhead_fraction'] * 100:.1f}%; the data path "
        f"alone {lo['data_path_s'] * 1e3:.2f} ms/step, {lo['data_path_fraction'] * 100:.1f}% of the bare step "
        f"(medians of {lo['rounds']} rounds, one step of each loop per round, CPU time, {lo['threads']} thread)")
    log(f"  the recipe end to end (train_one_epoch: device loader, normalisation, train_step, loss sums, stop "
        f"check) against the bare loop over ready-made batches: {pct(lo['overhead'])}")
    log(f"  of which the step's bookkeeping (train_one_epoch on the bare loop's batches, same work): "
        f"{pct(lo['bookkeeping'])}")
    log(f"  decision (target: at most 3%): the loop's own overhead is {lo['decision']['bookkeeping']}; end to end, "
        f"with the data path, {lo['decision']['end_to_end']}")
    log(f"  the per-step time split (StepLog's marks) against the same loop untimed: {pct(lo['timing_cost'])}; "
        f"target at most 1%: {lo['decision']['timing']}")
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
    for name, least in (("steps", 1), ("warmup", 0), ("rounds", 1)):  # this script's own flags
        if getattr(args, name) < least:
            raise UserError(f"--{name} must be at least {least}, got {getattr(args, name)}")
    env = utils.init_distributed(args.device, 600)  # rank, device, process group: NCCL or gloo
    torch.backends.cudnn.benchmark = True
    try:
        if args.cpu_checks:  # the recipe's loop on CPU, without DDP
            env = dataclasses.replace(env, device=torch.device("cpu"))
            cfg = recipe_config(args, env, device="cpu", amp="off", loader="gpu", workers=0, micro_batch=None,
                                compile=False)
        else:
            cfg = recipe_config(args, env)
        device = env.device
        result = {"config": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                  else cpu_name(), "world_size": env.world_size, "torch": torch.__version__,
                  "amp_dtype": str(cfg.amp_dtype), "hosts": sorted(set(all_gather(platform.node())))}
        if args.augment_share:
            result["augment_share"] = augment_share(args, env, du.make_synthetic(50_000, train=True))
        elif args.cpu_checks:
            log(f"cpu checks: WRN-{args.depth}-{args.widen_factor}, batch {args.batch_size}, {args.rounds} rounds "
                f"(about two minutes on 2 cores with the defaults)")
            t0 = time.perf_counter()
            result["cpu_checks"] = cpu_checks(args, cfg, env)
            report_cpu_checks(result["cpu_checks"], time.perf_counter() - t0)
        else:
            data = du.make_synthetic(50_000, train=True)  # CIFAR-100's training set size
            checked = bench_data(args, cfg, env, data)
            peak, peak_note = peak_flops(device, cfg.amp_dtype)
            ours = bench_ours(args, env, cfg, checked, data)
            ips = args.batch_size / ours["step_s"]
            ours.update(images_per_s=ips, images_per_s_per_gpu=ips / env.world_size,
                        mfu=ours["flops_per_image"] * ips / env.world_size / peak if peak else None,
                        peak_note=peak_note)
            result["ours"] = ours
            ms = lambda s: "n/a" if s is None else f"{s * 1e3:.2f} ms"  # noqa: E731
            ph = ours["phases"]
            log(f"ours: {ips:.0f} img/s, {ips / env.world_size:.0f} img/s per {device.type}, step {ms(ours['step_s'])} "
                f"(the recipe's train_one_epoch)")
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
                original = bench_original(args, env, cfg, data, checked)
                original["images_per_s"] = args.batch_size / original["step_s"]
                result["original"], result["speedup_vs_original"] = original, ips / original["images_per_s"]
                log(f"the original script's pipeline: {original['images_per_s']:.0f} img/s; ours is "
                    f"{result['speedup_vs_original']:.2f}x")
        name = f"bench-{''.join(c if c.isalnum() else '_' for c in result['device'])[:40]}-{env.world_size}x.json"
        path = args.json or os.path.join("runs", "bench", name)  # runs/ is git-ignored
        if env.is_main:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            write_json(path, result)
            log(f"wrote {path}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_tool(main, get_args_parser()))  # SIGTERM and Ctrl-C: out at once in one line; bad input: one line
