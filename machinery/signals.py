"""The training loop's checkpointed stop on a signal or the stop file (StopRequest), agreed by all ranks."""
import contextlib
import os
import signal

import torch

from machinery.errors import EXIT_STOPPED, all_reduce_max
from machinery.output import is_main_process, log, report_to_launcher, say

STOP_CHECK_EVERY = 10  # steps between the ranks' agreed checks (stop, non-finite loss, bad samples)
# Slurm's time-limit warning (USR1, as the job scripts ask); scancel, time limit, preemption (TERM); Ctrl-C.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by STOP_SIGNALS (a second Ctrl-C quits at once) or the file $DDP_STOP_FILE, which the job scripts create
    when their shell is signalled (it reaches every rank on every node, in a container too); ranks agree in `check`."""

    exit_status = EXIT_STOPPED  # stopped on request, checkpointed: rerun to resume

    def __init__(self):
        self.signal = None
        self.stop_file = os.environ.get("DDP_STOP_FILE")

    def __enter__(self) -> "StopRequest":  # caught in the training loop; outside it, as usual
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        quiet_resource_tracker()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    reason = property(lambda self: self.signal or "on another rank")  # what was seen here

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signal == "SIGINT":
            say("\nSecond Ctrl-C: quitting now, without a checkpoint (the last one is intact).\n")
            os._exit(130)
        if signum == signal.SIGINT:
            say(f"\nCtrl-C: stopping with a checkpoint within {STOP_CHECK_EVERY} steps; Ctrl-C again quits now.\n")
        self.signal = signal.Signals(signum).name

    def requested_here(self) -> bool:
        if self.signal is None and self.stop_file and os.path.exists(self.stop_file):
            self.signal = f"stop file {self.stop_file}"
        return self.signal is not None

    def say_stopped(self, message: str) -> None:
        """The stop's line, once checkpointed; rank 0 also writes $DDP_STOP_FILE.saved, which the job's shell reads."""
        log(message)
        report_to_launcher(message)  # torchrun's failure report then says why
        if self.stop_file and is_main_process():
            with contextlib.suppress(OSError), open(self.stop_file + ".saved", "w") as f:
                f.write(message + "\n")

    def check(self, device) -> bool:
        """One small all-reduce: True on every rank if any rank was asked to stop."""
        return bool(all_reduce_max(torch.full((), float(self.requested_here()), device=device)).item())


def quiet_resource_tracker() -> None:
    """Silence (before the first worker) the resource tracker's warning of semaphores that an exit at once leaves."""
    if "ignore:resource_tracker:UserWarning" not in (current := os.environ.get("PYTHONWARNINGS", "")):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [current, "ignore:resource_tracker:UserWarning"]))
