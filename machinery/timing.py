"""StepLog: progress lines, each rank's time by phase and what it says; --profile's traces."""
import os
import statistics
import sys
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from machinery.errors import all_gather, call_and_agree
from machinery.launch import host_name
from machinery.output import describe_span, is_main_process, log

PHASES = {  # a step's phases, in order, and what each means in a line
    "data": "waiting for data",            # the loader's next batch, its copy and normalisation
    "compute": "in forward and backward",  # up to the last gradient bucket's all-reduce launch
    "sync": "waiting on the other ranks",  # the all-reduce's tail, agreed checks, the epoch's loss sums
    "optimizer": "in the optimizer step",  # the update, grad scaler, BatchNorm buffers kept
    "other": "in the loop's bookkeeping",  # the LR, progress lines (a mid-epoch checkpoint: sync)
}
SLOW_RANK_THRESHOLD = 0.10  # own step time (all but sync) over the others' median by this: ranks differ a little
SLOW_RANK_FLOOR_S = 1.0  # and by this an epoch (less is noise)
INPUT_BOUND_SHARE = 0.5  # waiting for data over this share of a step: the loader lags


class Clock:
    """Time marks: a CUDA event (no host sync: GPU time), else perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1000


class StepLog:
    """Progress lines (update); this rank's time by PHASES (mark): CUDA events read at the epoch's end, GPU time."""

    def __init__(self, every: int, device: torch.device, *, timed: bool = True,
                 profile_dir: str | None = None, epochs: int = 0):
        self.device, self.timed, self.cuda, self.epochs = device, timed, device.type == "cuda", epochs
        self.clock = Clock(device)
        self.marks, self.steps, self.last_bucket = [], 0, None
        self.epochs_finished = 0  # the first here carries the start-up
        self.profile_dir, self.profiler = profile_dir, None
        self.tty = is_main_process() and sys.stdout.isatty()
        self.every = (min(every, 10) if self.tty else every) if is_main_process() else 0  # <= 0: no lines
        self.trained_until, self.between_s = None, 0.0  # between: evaluation, checkpoint
        self.base, self.shown = None, False  # base: (step, time, images) after the epoch's first

    def mark(self, phase: str) -> None:
        """What ends now: "start": nothing (the epoch starts or resumes); "data", "compute" (with DDP, the
        all-reduce's tail is sync), "optimizer"; "step" (its agreed checks) and "end" (the loss sums): sync."""
        if phase == "start":
            if self.trained_until is not None:  # evaluation, checkpoint: in the run ETA
                self.between_s = time.perf_counter() - self.trained_until
            self.marks, self.steps, self.last_bucket, self.base = [], 0, None, None
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            if self.profile_dir:  # --profile: steps 4-8 (1-3 warm up) of the first epoch here
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no back-end ERROR lines on a CPU
                activity = torch.profiler.ProfilerActivity  # CUDA's on CUDA runs only (not a CPU run's on a GPU host)
                self.profiler = torch.profiler.profile(
                    activities=[activity.CPU, *([activity.CUDA] if self.cuda else [])],
                    on_trace_ready=self.write_profile,
                    schedule=torch.profiler.schedule(wait=2, warmup=1, active=5, repeat=1))
                self.profiler.start()
        elif phase == "compute" and self.last_bucket is not None:
            self.marks.append(("compute", self.last_bucket))
            phase, self.last_bucket = "sync", None
        if self.timed:
            self.marks.append(("sync" if phase in ("step", "end") else phase, self.clock.mark()))
        if phase == "step":
            self.steps += 1
            if self.profiler:
                self.profiler.step()
        elif phase == "end":
            self.trained_until = time.perf_counter()
            if self.tty:
                print("\r" + " " * 100 + "\r", end="", flush=True)
            if self.profiler:  # a short epoch: what it recorded, not its evaluation
                self.profiler.stop()
                self.profiler = None

    def write_profile(self, profile) -> None:
        folder, self.profile_dir = self.profile_dir, None  # once per run
        call_and_agree(os.makedirs, folder, exist_ok=True)  # any rank's failure stops all, in one line
        call_and_agree(profile.export_chrome_trace, os.path.join(folder, f"rank{os.environ.get('RANK', 0)}.json"))
        log(f"Profile of steps 4-{profile.step_num} of this run's first epoch (from its start or resume), every rank: "
            f"{folder}/rank<r>.json (ui.perfetto.dev, chrome://tracing). Rank 0's top operators by own time:")
        if is_main_process():  # slow to build: only where it is shown
            sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
            log(profile.key_averages().table(sort_by=sort, row_limit=12))

    def update(self, epoch: int, step: int, steps: int, images: float, loss_sums, t0: float) -> None:
        """After a step: a progress line every `every` steps and after the first."""
        if self.every > 0 and (step % self.every == 0 or not self.shown):
            self.shown = True
            base_step, base_time, base_images = self.base or (0, t0, 0)  # after the first: start-up left out
            seconds = time.perf_counter() - base_time
            if self.base is None:
                eta = "ETA: from the next steps' pace (this one carries the start-up)"
            else:
                step_s = seconds / (step - base_step)
                eta_s = step_s * (steps - step)
                eta = f"epoch ETA {eta_s:.0f} s"
                if self.epochs:  # then each epoch left, with its evaluation
                    run_s = eta_s + self.between_s + (self.epochs - epoch) * (step_s * steps + self.between_s)
                    eta += f" | run ETA {describe_span(run_s)}"
            line = (f"  epoch {epoch} step {step}/{steps} | {(images - base_images) / max(seconds, 1e-9):.0f} img/s | "
                    f"loss {float(loss_sums[0]) / max(float(loss_sums[1]), 1):.4f} | {eta}")
            print("\r" + line if self.tty else line, end="" if self.tty else "\n", flush=True)
        self.base = self.base or (step, time.perf_counter(), images)  # after the line: its print is start-up too
        self.mark("other")

    def timed_hook(self, hook=None):
        """`hook` (None: allreduce_hook), marking each bucket's hand-off: the last ends compute. Untimed: `hook`."""
        if not self.timed:
            return hook

        def timed(state, bucket):
            self.last_bucket = self.clock.mark()
            return (hook or allreduce_hook)(state, bucket)
        return timed

    def finish_epoch(self, rank: int) -> dict:
        """A collective: every rank's split per step and what it says, as metrics.jsonl fields."""
        split, steps = dict.fromkeys(PHASES, 0.0), max(self.steps, 1)
        for (_, a), (phase, b) in zip(self.marks, self.marks[1:]):
            split[phase] += self.clock.seconds(a, b)
        mine = {"rank": rank, "host": host_name(), "steps": self.steps, "step_s": sum(split.values()) / steps,
                **{f"{phase}_s": s / steps for phase, s in split.items()}}
        if self.cuda:
            mine["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        ranks = all_gather(mine)
        fields = {"rank_times": ranks, "includes_start_up": not self.epochs_finished,  # slower: plots mark it
                  "slow_rank": self.timed and find_slow_rank(ranks),
                  "input_bound": self.timed and self.epochs_finished and find_input_bound(ranks),
                  "peak_memory_gib": self.cuda and max(r["peak_memory_gib"] for r in ranks)}
        self.epochs_finished += 1
        return {key: value for key, value in fields.items() if value}  # those that apply


def find_slow_rank(ranks: list) -> str | None:
    """The rank slower than the others (SLOW_RANK_*) and its costliest phase, or None."""
    if len(ranks) < 2 or not all(r["steps"] for r in ranks):
        return None
    r = max(ranks, key=lambda x: x["step_s"] - x["sync_s"])
    others = [x for x in ranks if x is not r]
    own, median = r["step_s"] - r["sync_s"], statistics.median(x["step_s"] - x["sync_s"] for x in others)
    if (median <= 0 or own <= median * (1 + SLOW_RANK_THRESHOLD)
            or (own - median) * r["steps"] < SLOW_RANK_FLOOR_S):
        return None
    excess = {p: r[f"{p}_s"] - statistics.median(x[f"{p}_s"] for x in others) for p in PHASES if p != "sync"}
    cause = max(excess, key=excess.get)
    return (f"rank {r['rank']} on {r['host']}: {own / median - 1:.0%} slower than the other ranks' "
            f"median, {r[f'{cause}_s'] / r['step_s']:.0%} of its step {PHASES[cause]}")


def find_input_bound(ranks: list) -> str | None:
    """The rank waiting for data most of its step (INPUT_BOUND_SHARE, SLOW_RANK_FLOOR_S), or None."""
    if not all(r["steps"] and r["step_s"] > 0 for r in ranks):
        return None
    worst = max(ranks, key=lambda r: r["data_s"] / r["step_s"])
    share = worst["data_s"] / worst["step_s"]
    if share <= INPUT_BOUND_SHARE or worst["data_s"] * worst["steps"] < SLOW_RANK_FLOOR_S:
        return None
    median = statistics.median(r["data_s"] / r["step_s"] for r in ranks)
    return (f"rank {worst['rank']} on {worst['host']} waited for data {share:.0%} of its step (the median rank: "
            f"{median:.0%})")
