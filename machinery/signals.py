"""Signals: the training loop's checkpointed stop (StopRequest) and the loader workers that must outlive it
(deaf_to_stop_signals). The tools' immediate one-line exit is machinery/tool_exit.py's."""
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


# ---------------------------------------------------------------- the loader workers
# Slurm, `timeout`, container runtimes and terminals signal every process of a run; a loader worker killed so takes
# its rank down ("DataLoader worker ... is killed by signal") before it checkpoints. So workers ignore the stop
# signals (the rank stops them once saved) and start with them held: one sent at start-up is neither fatal nor lost.


@contextlib.contextmanager
def stop_signals_held():
    """Around worker starts: the stop signals held in this thread (other threads take them, or they wait for the
    block's end); workers are born holding them until deaf_to_stop_signals. Registers end_workers_at_exit."""
    if end_workers_at_exit not in _registered:
        _registered.append(end_workers_at_exit)
        atexit.register(end_workers_at_exit)  # after multiprocessing's own exit handler, so it runs before it
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # The first worker's forkserver starts the resource tracker, whose start unblocks SIGINT and SIGTERM here:
        # start it first (born holding SIGUSR1 too), then hold them again. The forkserver and its workers inherit them.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_registered = []


def end_workers_at_exit() -> None:
    """At exit, SIGKILL loader workers still up (their loader not freed, e.g. in a cycle), without torch's "worker
    killed" error: multiprocessing's exit handler would SIGTERM them, which they ignore, and wait for ever."""
    children = multiprocessing.active_children()
    if children:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)


def deaf_to_stop_signals(worker_id: int = 0) -> None:
    """A loader worker's worker_init_fn: ignore the stop signals, then unblock them (those held are discarded)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def quiet_resource_tracker() -> None:
    """Silence (via PYTHONWARNINGS, so before the first worker) the resource tracker's warning, not its cleanup, of
    the loader queues' semaphores left by an exit at once (a tool's stop signal, a second Ctrl-C)."""
    ours = "ignore:resource_tracker:UserWarning"
    current = os.environ.get("PYTHONWARNINGS", "")
    if ours not in current:
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [current, ours]))
