"""Signals: the training loop's checkpointed stop (StopRequest: SIGUSR1, SIGTERM, Ctrl-C, the stop
file), and the loader workers that must outlive it (deaf_to_stop_signals). The tools' immediate one-line exit
is machinery/tool_exit.py's."""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
from multiprocessing import resource_tracker

import torch

from machinery.errors import EXIT_STOPPED, all_reduce_max
from machinery.output import is_main_process, log, report_to_launcher, say


STOP_CHECK_EVERY = 10  # steps between the ranks' agreed checks: a stop request, a non-finite loss, bad samples
# What asks a run to checkpoint and stop: Slurm's time-limit warning (USR1, as the job scripts ask for it),
# scancel, the time limit and preemption (TERM), Ctrl-C (INT).
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by SIGUSR1 or SIGTERM (Slurm's time-limit warning, scancel, preemption), by Ctrl-C
    (SIGINT; a second one quits at once), or by the file named in $DDP_STOP_FILE (which the job
    scripts create when their shell is signalled, as that reaches every rank on every node, in a
    container too). Ranks agree in `check`."""

    SIGNALS = STOP_SIGNALS
    exit_status = EXIT_STOPPED  # of a run stopped on request, checkpointed: run it again (requeue) to resume

    def __init__(self):
        self.signal = None
        self.stop_file = os.environ.get("DDP_STOP_FILE")
        self._previous = {}  # the handlers before __enter__

    def __enter__(self) -> "StopRequest":
        """Catch the signals while the training loop runs (`with StopRequest() as stop:`); outside it,
        Ctrl-C and SIGTERM act as usual."""
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
        """The stop's line, from rank 0, once its checkpoint is saved; with the job scripts' stop file, the
        same line in a file beside it ($DDP_STOP_FILE.saved): how the job's shell knows that the ranks
        checkpointed, whichever way the signal came (to the shell, or to the ranks alone) and whatever the
        launcher's status."""
        log(message)
        report_to_launcher(message)  # torchrun reports the ranks' 75 as a failure: its report says why
        if self.stop_file and is_main_process():
            with contextlib.suppress(OSError), open(self.stop_file + ".saved", "w") as f:
                f.write(message + "\n")

    def check(self, device) -> bool:
        """One small all-reduce: True on every rank if any rank was asked to stop."""
        flag = torch.full((), float(self.requested_here()), device=device)
        return bool(all_reduce_max(flag).item())


# ---------------------------------------------------------------- the loader workers
# Slurm (scancel, the time limit, preemption), `timeout`, container runtimes and a terminal send their signal
# to every process of a run, the DataLoader workers included. A worker killed by it takes its rank down with
# "DataLoader worker ... is killed by signal" before the rank can checkpoint; so the workers ignore the stop
# signals (the rank stops them once it has saved), and are started with the signals held back, so that one
# sent while a worker starts up is neither fatal to it nor lost to the rank.


@contextlib.contextmanager
def stop_signals_held():
    """Around the start of worker processes: the stop signals held back from this thread (any other thread of
    the process takes them, or they wait for the block's end); the workers are born holding them too, until
    deaf_to_stop_signals. Also sees to it that they end with this process (end_workers_at_exit)."""
    if end_workers_at_exit not in _registered:
        _registered.append(end_workers_at_exit)
        atexit.register(end_workers_at_exit)  # after multiprocessing's own exit handler, so it runs before it
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # The first worker (its forkserver) starts multiprocessing's resource tracker, whose start unblocks
        # SIGINT and SIGTERM in this thread on its way out: start it first (born holding SIGUSR1 too), then
        # hold them again. The forkserver is born holding them, and so is every worker it forks.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_registered = []


def end_workers_at_exit() -> None:
    """At exit, the loader workers still up (their loader not freed yet, as in a reference cycle): SIGKILL,
    without torch's "worker killed" error. multiprocessing's own exit handler would SIGTERM them, which they
    ignore, and wait for them for ever."""
    children = multiprocessing.active_children()
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)


def deaf_to_stop_signals(worker_id: int = 0) -> None:
    """A loader worker's first act (its worker_init_fn): ignore the stop signals, then let them through (the
    ones that came while it started up are discarded)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def quiet_resource_tracker() -> None:
    """The DataLoader workers' forkserver starts multiprocessing's resource tracker. After an exit at
    once (a stop signal in a tool, a second Ctrl-C in training) it removes the semaphores the loader's queues
    leave, and warns about them after this process's last line. Its warning, not its cleanup, is turned off
    here, through the environment it starts with (so before the first worker)."""
    ours = "ignore:resource_tracker:UserWarning"
    current = os.environ.get("PYTHONWARNINGS", "")
    if ours not in current:
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [current, ours]))
