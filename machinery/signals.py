"""Signals: the training loop's checkpointed stop (StopRequest). The loader workers that must outlive a stop
signal are machinery/loader_workers.py's; the tools' immediate one-line exit is tools/tool_exit.py's."""
from __future__ import annotations

import contextlib
import os
import signal

import torch

from machinery.errors import EXIT_STOPPED, all_reduce_max
from machinery.output import is_main_process, log, report_to_launcher, say


STOP_CHECK_EVERY = 10  # steps between the ranks' agreed checks: a stop request, a non-finite loss, bad samples
# Slurm's time-limit warning (USR1, as the job scripts ask), scancel, time limit and preemption (TERM), Ctrl-C (INT).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by STOP_SIGNALS (a second Ctrl-C quits at once) or the file $DDP_STOP_FILE, which the job scripts create
    when their shell is signalled (it reaches every rank on every node, in a container too); ranks agree in `check`."""

    SIGNALS = STOP_SIGNALS
    exit_status = EXIT_STOPPED  # of a run stopped on request, checkpointed: run it again (requeue) to resume

    def __init__(self):
        self.signal = None
        self.stop_file = os.environ.get("DDP_STOP_FILE")
        self._previous = {}  # the handlers before __enter__

    def __enter__(self) -> "StopRequest":
        """Catch the signals while the training loop runs; outside it, Ctrl-C and SIGTERM act as usual."""
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        quiet_resource_tracker()
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
            say("\nSecond Ctrl-C: quitting now, without a checkpoint (the last one is intact).\n")
            os._exit(130)
        if signum == signal.SIGINT:
            say("\nCtrl-C: stopping at the next check (within 10 steps) with a checkpoint; Ctrl-C again to "
                "quit now.\n")
        self.signal = signal.Signals(signum).name

    def requested_here(self) -> bool:
        if self.signal is None and self.stop_file and os.path.exists(self.stop_file):
            self.signal = f"stop file {self.stop_file}"
        return self.signal is not None

    def say_stopped(self, message: str) -> None:
        """The stop's line, once the checkpoint is saved; rank 0 also writes it to $DDP_STOP_FILE.saved: how the
        job's shell knows the ranks checkpointed, however the signal came and whatever the launcher's status."""
        log(message)
        report_to_launcher(message)  # torchrun reports the ranks' 75 as a failure: its report says why
        if self.stop_file and is_main_process():
            with contextlib.suppress(OSError), open(self.stop_file + ".saved", "w") as f:
                f.write(message + "\n")

    def check(self, device) -> bool:
        """One small all-reduce: True on every rank if any rank was asked to stop."""
        flag = torch.full((), float(self.requested_here()), device=device)
        return bool(all_reduce_max(flag).item())


def quiet_resource_tracker() -> None:
    """Silence (via PYTHONWARNINGS, so before the first worker) the resource tracker's warning, not its cleanup, of
    the loader queues' semaphores left by an exit at once (a tool's stop signal, a second Ctrl-C)."""
    ours = "ignore:resource_tracker:UserWarning"
    current = os.environ.get("PYTHONWARNINGS", "")
    if ours not in current:
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [current, ours]))
