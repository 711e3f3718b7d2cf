"""What bench.py measures with: the recipe's own loop run N steps at a time (TrainSteps), the same loop with
timer marks between the phases of each step (time_phases), and the device's facts (its name, its dense
bf16/fp16 peak, an image's FLOPs). bench.py and --cpu-checks (tools/cpu_checks.py) both time TrainSteps."""
import dataclasses
import os
import platform
import re
import statistics

import torch

import train_ddp
import train_utils as utils
from machinery.errors import UserError
from machinery.timing import Clock, StepLog

# Dense (no sparsity) bf16/fp16 tensor-core peaks, FLOP/s, from NVIDIA's data sheets.
PEAK_FLOPS = {"H200": 989e12, "H100 SXM": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "A40": 150e12, "V100": 125e12}


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


def flops_per_image(model, device, amp_dtype):
    """Forward + backward FLOPs of one image, counted by torch.utils.flop_counter."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn(8, 3, 32, 32, device=device)
    x = x.contiguous(memory_format=torch.channels_last)  # as the recipe feeds its model
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            model(x).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 8



class TrainSteps:
    """N steps of the recipe's own loop, train_ddp.train_one_epoch, on `training`: each call of it enters an
    epoch where no more steps are left than are still to run (as a resumed run enters it), and the step count
    runs on from call to call (a stop check every STOP_CHECK_EVERY steps, as in one long run). Also the
    loop's checkpoint, which saves nothing (cfg.checkpoint_every is 0)."""

    def __init__(self, model, training, cfg, *, checks=None, step_log=None):
        self.model, self.training, self.cfg = model, training, cfg
        self.per_epoch = training.train_loader.batch_sampler.num_samples // cfg.batch_size
        # The recipe's agreed checks; outside a `with`, they install no signal handlers.
        self.checks = checks or utils.RunChecks(training.train_loader, training.normalize.scale.device,
                                                allow_nonfinite=training.scaler.is_enabled())
        # The recipe's: no progress lines (0), each step's phases timed, as in training.
        self.step_log = step_log or StepLog(0, training.normalize.scale.device)
        self.steps = self.epoch = 0

    def run(self, n: int) -> None:
        while n > 0:
            k, self.epoch = min(n, self.per_epoch), self.epoch + 1
            progress = utils.Progress(position=(self.per_epoch - k) * self.cfg.batch_size, step=self.steps)
            if train_ddp.train_one_epoch(self.model, self.training, epoch=self.epoch, cfg=self.cfg,
                                         progress=progress, step_log=self.step_log, checks=self.checks,
                                         checkpoint=self):
                raise UserError(f"stop requested ({self.checks.reason}): the benchmark ends unfinished")
            self.steps, n = self.steps + k, n - k

    def seconds_per_step(self, n: int) -> float:
        """run(n), timed: the mean seconds of a step (GPU time on CUDA: machinery.timing.Clock)."""
        clock = Clock(self.training.normalize.scale.device)
        start = clock.mark()
        self.run(n)
        return clock.seconds(start, clock.mark()) / n

    def save(self, progress) -> None:
        pass


class Marked:
    """`inner` (the Training's normalisation or scaler, the loop's stop check or progress log) with a timer
    mark, named after the phase it ends, before or after each call of the methods named. Other attributes:
    inner's."""

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


class MarkedStepLog(StepLog):
    """The recipe's StepLog (no progress lines), with a timer mark after each step's progress update ("step") and
    each epoch's start ("epoch")."""

    def __init__(self, device, timer):
        super().__init__(0, device)
        self.timer = timer

    def mark(self, phase: str) -> None:
        super().mark(phase)
        if phase == "start":
            self.timer("epoch")

    def update(self, *args) -> None:
        super().update(*args)
        self.timer("step")


def time_phases(model, training, cfg, steps: int, warmup: int = 3) -> dict:
    """The recipe's loop, run separately with timer marks between the phases of each step: data (from the end
    of the previous step: the LR, the loader's batch, the step split, the copy and normalisation),
    forward+backward (all micro-batches, the loss sums), optimizer (the scaler's step and update). Left out:
    the stop check every STOP_CHECK_EVERY steps, and an epoch's start and end (the data phase of an epoch's
    first step)."""
    device = training.normalize.scale.device
    clock, marks = Clock(device), []

    def mark(what):  # what: the phase that ends here, or None
        if what:
            marks.append((what, clock.mark()))
    marked = dataclasses.replace(
        training, normalize=Marked(training.normalize, mark, after={"__call__": "data"}),
        scaler=Marked(training.scaler, mark, before={"step": "fwd_bwd"}, after={"update": "optimizer"}))
    checks = Marked(utils.RunChecks(training.train_loader, device, allow_nonfinite=training.scaler.is_enabled()),
                    mark, after={"check": "stop check"})
    loop = TrainSteps(model, marked, cfg, checks=checks, step_log=MarkedStepLog(device, mark))
    loop.run(warmup)
    marks.clear()
    loop.run(steps)
    phases = {"data": [], "fwd_bwd": [], "optimizer": []}
    for (before, a), (what, b) in zip(marks, marks[1:]):
        if what in phases and (what != "data" or before in ("step", "stop check")):
            phases[what].append(clock.seconds(a, b))
    return {f"{name}_s": statistics.mean(s) if s else None for name, s in phases.items()}
