"""StepLog: rank 0's progress lines, each rank's time by phase (what it says: rank_times.py), --profile's traces
(profiler.py)."""
from __future__ import annotations

import sys
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from machinery.errors import all_gather
from machinery.launch import host_name
from machinery.output import describe_span, is_main_process
from machinery.phases import PHASES


class Clock:
    """Time marks (StepLog's, bench.py's): a CUDA event in the stream (no host sync: GPU time), else perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        """From mark a to mark b; on CUDA it waits for b (an event already passed returns at once)."""
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1000


class StepLog:
    """Rank 0's progress lines (update) and this rank's split of its time into PHASES (mark: what ends now),
    compared across ranks by finish_epoch. CUDA marks are read at the epoch's end (no sync per step), so the split
    is GPU time: a GPU idle for want of data shows it as data. `profile_dir`: --profile's traces. DDP's all-reduce is
    timed by the comm hook it wraps (timed_hook)."""

    def __init__(self, every: int, device: torch.device, *, timed: bool = True,
                 profile_dir: str | None = None, epochs: int = 0):
        self.progress = ProgressLines(every, epochs)
        self.device, self.timed, self.cuda = device, timed, device.type == "cuda"
        self.clock = Clock(device)
        self.now = self.clock.mark  # a mark in time, read at the epoch's end
        self.marks, self.steps, self.last_bucket = [], 0, None
        self.epochs_finished = 0  # in this process: its first epoch carries the start-up
        self.profiler = None
        if profile_dir:
            from machinery.profiler import Profiler
            self.profiler = Profiler(profile_dir, self.cuda)

    def mark(self, phase: str) -> None:
        """The step log's one mark: what ends now. "start": nothing; the epoch's training starts (or resumes) here.
        A step's phases (PHASES): "data"; "compute", forward and backward (with DDP, compute until its last
        bucket's all-reduce is launched, then the all-reduce's tail as sync); "optimizer". "step": the step's
        agreed checks (sync); the step is done. "end": the epoch's training, after its loss sums (sync)."""
        if phase == "start":
            self.progress.start()
            self.marks, self.steps, self.last_bucket = [("start", self.now())] if self.timed else [], 0, None
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            return
        if phase == "compute" and self.timed and self.last_bucket is not None:
            self.marks.append(("compute", self.last_bucket))
            phase = "sync"
        if self.timed:
            self.marks.append(("sync" if phase in ("step", "end") else phase, self.now()))
        if phase in ("compute", "sync"):
            self.last_bucket = None
        elif phase == "step":
            self.steps += 1
            if self.profiler:
                self.profiler.after_step(self.steps)
        elif phase == "end":
            self.progress.clear()
            if self.profiler:
                self.profiler.finish()  # an epoch shorter than the window: what it recorded, not its evaluation

    def update(self, epoch: int, step: int, steps: int, images: float, loss_sums, t0: float) -> None:
        """After a step: the progress line if one is due. `loss_sums`: the epoch's loss summed over its finite
        samples, and their count (device tensors: read only for a line)."""
        def loss():
            return float(loss_sums[0]) / max(float(loss_sums[1]), 1)
        self.progress.update(epoch, step, steps, images, loss, t0)
        self.mark("other")

    def timed_hook(self, hook=None):
        """DDP's comm hook (None: its all-reduce, as allreduce_hook) with a time mark at each bucket's hand-off, for
        ddp.register_comm_hook: the last bucket's ends backward's compute, so computing and waiting for the network
        come apart in the step's time split. Not timed: `hook` itself (None: DDP's built-in C++ all-reduce)."""
        if not self.timed:
            return hook

        def timed(state, bucket):
            self.last_bucket = self.now()
            return (hook or allreduce_hook)(state, bucket)
        return timed

    def seconds(self) -> dict:
        """This rank's time in each phase since start(), in seconds."""
        split = dict.fromkeys(PHASES, 0.0)
        if len(self.marks) < 2:
            return split
        previous = self.marks[0][1]
        for phase, t in self.marks[1:]:
            split[phase] += self.clock.seconds(previous, t)
            previous = t
        return split

    def finish_epoch(self, rank: int) -> dict:
        """A collective at the epoch's end: every rank's split per step, the slow-rank line if any, and on CUDA the
        peak memory; fields for the epoch's row of metrics.jsonl."""
        split = self.seconds()
        mine = {"rank": rank, "host": host_name(), "steps": self.steps,
                "step_s": sum(split.values()) / max(self.steps, 1),
                **{f"{phase}_s": s / max(self.steps, 1) for phase, s in split.items()}}
        if self.cuda:
            mine["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        ranks = all_gather(mine)
        fields = {"rank_times": ranks}
        if not self.epochs_finished:  # a new run's epoch 1, or a resumed run's first: slower, said so (plots)
            fields["includes_start_up"] = True
        self.epochs_finished += 1
        if self.timed:  # what the ranks' splits say, where it matters: a slow rank, a loader that falls behind
            from machinery.rank_times import find_input_bound, find_slow_rank
            if slow := find_slow_rank(ranks):
                fields["slow_rank"] = slow
            if "includes_start_up" not in fields and (waiting := find_input_bound(ranks)):
                fields["input_bound"] = waiting
        if self.cuda:
            fields["peak_memory_gib"] = max(r["peak_memory_gib"] for r in ranks)
        return fields


class ProgressLines:
    """Rank 0's progress in an epoch: a live line on a terminal, else a line every `every` steps (no TTY)."""

    def __init__(self, every: int, epochs: int = 0):
        self.epochs, self.trained_until, self.between_s = epochs, None, 0.0  # between: evaluation, checkpoint
        self.base = None  # (step, perf_counter, images) after this epoch's first step here: the pace's start
        self.is_main = is_main_process()
        self.tty = self.is_main and sys.stdout.isatty()
        self.every = 0 if every <= 0 else (min(every, 10) if self.tty else every)  # 0: no progress lines
        self.shown = False

    def due(self, step: int) -> bool:
        """Every `every` steps, and after the run's first step: a slow start still shows signs of life."""
        return self.is_main and self.every > 0 and (step % self.every == 0 or not self.shown)

    def start(self) -> None:
        """An epoch starts: the time since the last one's training (evaluation, checkpoint) counts in the run ETA."""
        if self.trained_until is not None:
            self.between_s = time.perf_counter() - self.trained_until
        self.base = None

    def show(self, epoch: int, step: int, steps: int, images: float, loss: float, elapsed: float) -> None:
        """The line. Its pace and ETA count from the end of the epoch's first step here (since a resume), which
        carries the start-up (workers, cuDNN's search, a compile), so that step's own line has no ETA."""
        self.shown = True
        line = f"  epoch {epoch} step {step}/{steps} | "
        if self.base is None or step <= self.base[0]:
            line += (f"{images / max(elapsed, 1e-9):.0f} img/s | loss {loss:.4f} | ETA: from the next steps' "
                     f"pace (this one carries the start-up)")
        else:
            base_step, base_time, base_images = self.base
            seconds = time.perf_counter() - base_time
            step_s = seconds / (step - base_step)  # the pace, start-up left out
            eta = step_s * (steps - step)
            line += (f"{(images - base_images) / max(seconds, 1e-9):.0f} img/s | loss {loss:.4f} | "
                     f"epoch ETA {eta:.0f} s")
            if self.epochs:  # this epoch's rest, then each epoch left at this pace, its evaluation included
                run_s = eta + self.between_s + (self.epochs - epoch) * (step_s * steps + self.between_s)
                line += f" | run ETA {describe_span(run_s)}"
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", flush=True)

    def update(self, epoch: int, step: int, steps: int, images: float, loss, t0: float) -> None:
        """Show the line if one is due: it reads the loss (loss()), a wait for the GPU, so not every step."""
        if self.due(step):
            self.show(epoch, step, steps, images, loss(), time.perf_counter() - t0)
        if self.base is None and self.is_main:  # after the line: its print is start-up too
            self.base = (step, time.perf_counter(), images)

    def clear(self) -> None:
        self.trained_until = time.perf_counter()
        if self.tty:
            print("\r" + " " * 100 + "\r", end="", flush=True)
