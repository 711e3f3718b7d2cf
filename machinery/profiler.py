"""--profile: torch.profiler over a few training steps on every rank, a trace per rank and rank 0's table of the
top operators. Imported only when the flag is given."""
import os

import torch

from machinery.errors import call_and_agree
from machinery.output import log


class Profiler:
    """--profile: torch.profiler over ACTIVE steps after the first SKIP of an epoch (its warm-up: the
    loaders start, cuDNN picks its kernels), once per run, on every rank. Rank r writes its trace to
    `folder`/rank{r}.json (ui.perfetto.dev and chrome://tracing open it); rank 0 logs a table of the top
    operators. Training goes on unchanged; the profiled steps run slower, and so does their epoch."""
    SKIP, ACTIVE = 3, 5

    def __init__(self, folder: str, cuda: bool):
        (self.folder, self.cuda, self.profile, self.first, self.last,
         self.done) = folder, cuda, None, 0, 0, False

    def after_step(self, step: int) -> None:
        self.last = step
        if step == self.SKIP and not self.done and self.profile is None:
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's back end: no ERROR lines on a CPU
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                                  if self.cuda else [])
            self.profile, self.first = torch.profiler.profile(activities=activities), step + 1
            self.profile.start()
        elif step == self.SKIP + self.ACTIVE:
            self.finish()

    def finish(self) -> None:
        """Stop the profiler if it runs, and write the traces (every rank) and the table (rank 0)."""
        if self.profile is None:
            return
        profile, self.profile, self.done = self.profile, None, True
        profile.stop()
        rank = int(os.environ.get("RANK", 0))
        path = os.path.join(self.folder, f"rank{rank}.json")

        def write_trace():
            os.makedirs(self.folder, exist_ok=True)
            profile.export_chrome_trace(path)
        call_and_agree(write_trace)  # every rank writes its own; a failed write stops them all in one line
        steps = f"{self.first}-{self.last}" if self.last > self.first else f"{self.first}"
        log(f"Profile of steps {steps} of this run's first epoch (counted from where it started or resumed) "
            f"on every rank: {self.folder}/rank<r>.json (open in ui.perfetto.dev or chrome://tracing). "
            f"Rank 0's top operators by their own time:")
        if rank == 0:  # the table takes a while to build: only where it is shown
            sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
            log(profile.key_averages().table(sort_by=sort, row_limit=12))
