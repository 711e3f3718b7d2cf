"""Benchmark the training step, launched like training (plain python or torchrun).

    torchrun --standalone --nproc_per_node=4 bench.py --compile --compare-seed   # GPUs
    python bench.py --cpu-checks --depth 10 --widen-factor 1 --batch-size 64    # CPU

It prints img/s (global and per GPU), the step split into data, forward+backward, optimizer and
exposed communication, MFU against the device's dense bf16/fp16 tensor-core peak, and peak memory,
and writes all of it, with the exact configuration, as JSON. --compare-seed times the seed's
pipeline (CPU DataLoader with PIL transforms, fp16 autocast, no channels_last, no compile) on the
same device in the same run. --cpu-checks measures, per CPU core, batched tensor augmentation
against the PIL per-sample path, and the training loop's overhead against a bare loop.
GPU time is taken with CUDA events, CPU time with the wall clock, after warm-up steps.
"""
import argparse
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
from model import WideResNet
from train_utils import (UserError, all_gather, init_distributed, log, pick_device, read_dist_env, resolve_amp,
                         write_json)

# Dense (no sparsity) bf16/fp16 tensor-core peaks, FLOP/s, from NVIDIA's data sheets.
PEAK_FLOPS = {"H200": 989e12, "H100 SXM": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "A40": 150e12, "V100": 125e12}


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch-size", type=int, default=512, help="global batch size")
    p.add_argument("--depth", type=int, default=16, help="WideResNet depth")
    p.add_argument("--widen-factor", type=int, default=8, help="WideResNet width")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compile, cuDNN autotuning)")
    p.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto", help="as in train_ddp.py")
    p.add_argument("--loader", choices=["gpu", "torch"], default="gpu", help="our data path: on the device, or a DataLoader")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP gradient bucket size (DDP's default: 25)")
    p.add_argument("--static-graph", action="store_true", help="DDP static_graph=True (the same graph every step)")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank (the seed used 8)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="as in train_ddp.py")
    p.add_argument("--compare-seed", action="store_true", help="also time the seed's pipeline, same device, same run")
    p.add_argument("--cpu-checks", action="store_true", help="augmentation per core, and loop overhead vs a bare loop")
    p.add_argument("--json", default="", help="write the results here (default: runs/bench/bench-<device>-<ws>x.json)")
    return p


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


def time_steps(model, batches, optimizer, scaler, amp_dtype, device, steps, warmup, split):
    """Run warmup + steps training steps; returns mean seconds per step, and with `split` the mean
    seconds of each phase (data, forward+backward, optimizer). `batches()` yields normalised inputs."""
    timer, loss_fn = Timer(device), nn.CrossEntropyLoss()
    phases, it = [], batches()
    model.train()
    start = None
    for i in range(warmup + steps):
        if i == warmup:
            start = timer.mark()
        t0 = timer.mark() if split else None
        images, labels = next(it)
        t1 = timer.mark() if split else None
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        t2 = timer.mark() if split else None
        scaler.step(optimizer)
        scaler.update()
        if split:
            phases.append((t0, t1, t2, timer.mark()))
    total = timer.seconds(start, timer.mark()) / steps
    if not split:
        return total, None
    parts = [[timer.seconds(p[k], p[k + 1]) for p in phases[warmup:]] for k in range(3)]
    return total, [statistics.mean(x) for x in parts]


def our_batches(loader, normalize):
    """Endless batches from our pipeline: the device loader (or DataLoader) plus on-device normalisation."""
    epoch = 0
    while True:
        epoch += 1
        loader.batch_sampler.set_epoch(epoch)
        for images, labels in loader:
            yield normalize(images.to(normalize.scale.device, non_blocking=True)), labels.to(normalize.scale.device, non_blocking=True)


def seed_transform():
    """The seed's per-sample training transform on PIL images."""
    import torchvision.transforms as T
    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD)])


def seed_batches(data, per_rank_batch, env, workers, device):
    """The seed's input pipeline: PIL images through torchvision transforms in DataLoader workers."""
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset, DistributedSampler
    tf = seed_transform()

    class PILSet(Dataset):
        def __init__(self):
            self.images = data.images.permute(0, 2, 3, 1).numpy()  # HWC uint8, as torchvision's CIFAR100

        def __len__(self):
            return len(self.images)

        def __getitem__(self, i):
            return tf(Image.fromarray(self.images[i])), int(data.labels[i])
    sampler = DistributedSampler(PILSet(), num_replicas=env.world_size, rank=env.rank)
    loader = DataLoader(PILSet(), batch_size=per_rank_batch, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda", persistent_workers=workers > 0, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        epoch += 1
        for images, labels in loader:
            yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def build(args, env, device, channels_last, compile_model, fused):
    torch.manual_seed(0)
    model = WideResNet(args.depth, args.widen_factor, du.CIFAR100_CLASSES)
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, fused=fused)
    ddp = DDP(model, device_ids=[env.local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True,
              bucket_cap_mb=args.bucket_cap_mb, static_graph=args.static_graph) if dist.is_initialized() else model
    return model, (torch.compile(ddp, dynamic=False) if compile_model else ddp), optimizer


def bench_ours(args, env, device, amp_dtype, data):
    per_rank = args.batch_size // env.world_size
    cuda = device.type == "cuda"
    bare, model, optimizer = build(args, env, device, channels_last=cuda, compile_model=args.compile, fused=cuda)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    test = du.ImageData(data.images[:10_000], data.labels[:10_000])  # CIFAR-100's test set size
    train, _ = du.build_loaders(data, test, args.batch_size, env.rank, env.world_size, 1, per_rank, 0, args.workers,
                                cuda, device=device if args.loader == "gpu" else None)
    normalize = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, device, channels_last=cuda)
    batches = lambda: our_batches(train, normalize)  # noqa: E731
    step_s, _ = time_steps(model, batches, optimizer, scaler, amp_dtype, device, args.steps, args.warmup, split=False)
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None  # training, data included
    _, (data_s, fwd_bwd_s, opt_s) = time_steps(model, batches, optimizer, scaler, amp_dtype, device,
                                                max(10, args.steps // 2), 3, split=True)
    comm_s = None
    if env.world_size > 1 and not args.compile:  # DDP minus no_sync: the communication not hidden by backward
        with model.no_sync():
            _, (_, local_s, _) = time_steps(model, batches, optimizer, scaler, amp_dtype, device,
                                            max(10, args.steps // 2), 3, split=True)
        comm_s = max(0.0, fwd_bwd_s - local_s)
    flops = flops_per_image(bare, device, amp_dtype, cuda)
    # One full epoch of augmentation on one device (all 50,000 images, this rank's batch size).
    everything, _ = du.build_loaders(data, data, per_rank, 0, 1, 1, per_rank, 0, 0, False, device=device)
    everything.batch_sampler.set_epoch(1)
    timer = Timer(device)
    for _ in everything:  # warm-up
        break
    t0 = timer.mark()
    for images, _ in everything:
        pass
    aug_epoch_s = timer.seconds(t0, timer.mark())
    return {"step_s": step_s, "augment_epoch_s": aug_epoch_s, "augment_epoch_images": len(data.labels), "data_s": data_s, "fwd_bwd_s": fwd_bwd_s, "optimizer_s": opt_s,
            "exposed_comm_s": comm_s, "flops_per_image": flops, "peak_memory_gib": peak_memory}


def bench_seed(args, env, device, data):
    per_rank = args.batch_size // env.world_size
    _, model, optimizer = build(args, env, device, channels_last=False, compile_model=False, fused=False)
    amp = torch.float16 if device.type == "cuda" else None  # the seed: fp16 autocast on CUDA
    scaler = torch.amp.GradScaler(device.type, enabled=amp is not None)
    batches = lambda: seed_batches(data, per_rank, env, args.workers, device)  # noqa: E731
    step_s, _ = time_steps(model, batches, optimizer, scaler, amp, device, args.steps, args.warmup, split=False)
    return {"step_s": step_s}


def cpu_checks(args):
    """Per-core comparisons that need no GPU."""
    torch.set_num_threads(1)
    from PIL import Image
    data = du.make_synthetic(4096, train=True)
    tf = seed_transform()
    hwc = data.images.permute(0, 2, 3, 1).numpy()
    pil_rates, tensor_rates = [], []
    normalize = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, torch.device("cpu"))
    pad = du.crop_padding(*data.images.shape[-2:])
    padded = du.pad_images(data.images, pad)
    for rnd in range(3):  # interleaved rounds, the median of each
        t = time.perf_counter()
        for i in range(1024):
            tf(Image.fromarray(hwc[i]))
        pil_rates.append(1024 / (time.perf_counter() - t))
        t = time.perf_counter()
        for s in range(0, 4096, 512):
            idx = torch.arange(s, s + 512)
            normalize(du.crop_flip_batch(padded, idx, du.mix64(0, rnd, idx), pad))
        tensor_rates.append(4096 / (time.perf_counter() - t))
    aug = {"pil_img_per_s_per_core": statistics.median(pil_rates),
           "tensor_img_per_s_per_core": statistics.median(tensor_rates)}
    aug["speedup"] = aug["tensor_img_per_s_per_core"] / aug["pil_img_per_s_per_core"]

    # The training loop's own overhead: our loop (device loader, normalisation, loss bookkeeping,
    # the stop check every 10 steps) against a bare loop over ready-made batches.
    import train_ddp
    from train_utils import STOP_CHECK_EVERY, StopRequest
    torch.set_num_threads(os.cpu_count() or 1)
    device, batch = torch.device("cpu"), args.batch_size
    model = WideResNet(args.depth, args.widen_factor, du.CIFAR100_CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler, loss_fn = torch.amp.GradScaler("cpu", enabled=False), nn.CrossEntropyLoss()
    sum_loss = nn.CrossEntropyLoss(reduction="sum")  # what train_step takes
    small = du.ImageData(data.images[:batch * 20], data.labels[:batch * 20])
    loader, _ = du.build_loaders(small, small, batch, 0, 1, 1, batch, 0, 0, False, device=device)
    ready = [(normalize(x), y) for x, y in loader]
    stop = StopRequest()

    def ours_loop(epoch):
        loader.batch_sampler.set_epoch(epoch)
        t = time.perf_counter()
        sums = torch.zeros(3, dtype=torch.float64)
        for step, (images, labels) in enumerate(loader, 1):  # as in train_ddp.py's loop
            sums += train_ddp.train_step(model, images, labels, normalize, optimizer, scaler, sum_loss, None,
                                         [len(labels)], len(labels))
            if step % STOP_CHECK_EVERY == 0:
                stop.check(device, sums, False)
        return (time.perf_counter() - t) / len(loader)

    def bare_loop(epoch):
        t = time.perf_counter()
        for images, labels in ready:
            loss = loss_fn(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - t) / len(ready)

    # Interleaved rounds in alternating order, the first discarded as warm-up; medians compared.
    ours_s, bare_s = [], []
    for rnd in range(9):
        first, second = (ours_loop, bare_loop) if rnd % 2 else (bare_loop, ours_loop)
        a, b = first(rnd), second(rnd)
        if rnd:
            (ours_s if first is ours_loop else bare_s).append(a)
            (bare_s if first is ours_loop else ours_s).append(b)
    ours, bare = statistics.median(ours_s), statistics.median(bare_s)
    t = time.perf_counter()  # the data path alone (device loader and normalisation): the overhead's bulk
    for rnd in range(5):
        loader.batch_sampler.set_epoch(100 + rnd)
        for images, _ in loader:
            normalize(images)
    data_s = (time.perf_counter() - t) / (5 * len(loader))
    loop = {"model": f"WRN-{args.depth}-{args.widen_factor}", "batch": batch, "ours_step_s": ours,
            "bare_step_s": bare, "overhead_fraction": (ours - bare) / ours, "data_path_s": data_s,
            "data_path_fraction": data_s / bare}
    return {"augmentation": aug, "loop_overhead": loop}


def main(args):
    env = read_dist_env()
    env.device = device = pick_device(args.device, env.local_rank)
    init_distributed(env, 600)  # sets this rank's GPU first
    amp_dtype = resolve_amp(args.amp, device)
    torch.backends.cudnn.benchmark = True
    try:
        result = {"config": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                  else cpu_name(), "world_size": env.world_size, "torch": torch.__version__,
                  "amp_dtype": str(amp_dtype), "hosts": sorted(set(all_gather(platform.node())))}
        if args.cpu_checks:
            result["cpu_checks"] = c = cpu_checks(args)
            a, lo = c["augmentation"], c["loop_overhead"]
            log(f"augmentation, 1 core: PIL per sample {a['pil_img_per_s_per_core']:.0f} img/s, "
                f"batched tensor ops {a['tensor_img_per_s_per_core']:.0f} img/s: {a['speedup']:.1f}x")
            log(f"loop overhead ({lo['model']}, batch {lo['batch']}): {lo['ours_step_s'] * 1e3:.1f} ms/step vs "
                f"bare {lo['bare_step_s'] * 1e3:.1f} ms/step: {lo['overhead_fraction'] * 100:.1f}%; the data path "
                f"alone {lo['data_path_s'] * 1e3:.2f} ms/step, {lo['data_path_fraction'] * 100:.1f}% of the bare step")
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
            log(f"ours: {ips:.0f} img/s, {ips / env.world_size:.0f} img/s per {device.type}, step {ms(ours['step_s'])} "
                f"(data {ms(ours['data_s'])}, fwd+bwd {ms(ours['fwd_bwd_s'])}, optimizer {ms(ours['optimizer_s'])}, "
                f"exposed comm {ms(ours['exposed_comm_s'])})")
            log(f"augmentation of one {ours['augment_epoch_images']}-image epoch on one {device.type}: "
                f"{ours['augment_epoch_s'] * 1e3:.1f} ms")
            mfu = "n/a" if ours["mfu"] is None else f"{ours['mfu'] * 100:.1f}%"
            mem = "n/a" if ours["peak_memory_gib"] is None else f"{ours['peak_memory_gib']:.2f} GiB"
            log(f"MFU: {mfu} ({ours['flops_per_image'] / 1e9:.2f} GFLOP per image fwd+bwd; {peak_note}); "
                f"peak memory {mem}")
            if args.compare_seed:
                seed = bench_seed(args, env, device, data)
                seed["images_per_s"] = args.batch_size / seed["step_s"]
                result["seed"], result["speedup_vs_seed"] = seed, ips / seed["images_per_s"]
                log(f"seed pipeline: {seed['images_per_s']:.0f} img/s; ours is {result['speedup_vs_seed']:.2f}x")
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
    try:
        main(get_args_parser().parse_args())
    except UserError as e:
        log(f"error: {e}", file=sys.stderr)
        sys.exit(2)
