"""Signals: the training loop's checkpointed stop (StopRequest: SIGUSR1, SIGTERM, Ctrl-C, the stop
file), the loader workers that must outlive it (deaf_to_stop_signals), and the tools' immediate one-line
exit on SIGTERM and Ctrl-C (catch_stop_signals)."""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing import resource_tracker

import torch

from machinery.errors import EXIT_STOPPED, UserError, all_reduce_max
from machinery.launch import read_dist_env
from machinery.output import is_main_process, log, report_to_launcher, say


STOP_CHECK_EVERY = 10  # steps between the ranks' checks for a stop request or a non-finite loss
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
        self.prev_sums = None  # the sums at the previous check (fp16's divergence test)
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

    def check(self, device, *, finite_samples, samples, allow_nonfinite: bool) -> bool:
        """One small all-reduce: True if any rank was asked to stop. Raises if any rank's loss went
        non-finite: of this epoch's `samples` so far, only `finite_samples` had a finite loss (numbers or
        0-d tensors). With fp16 the grad scaler skips the odd overflowing step, so only divergence stops the
        run: a majority of non-finite losses since the previous check."""
        counts = torch.stack([torch.as_tensor(n, dtype=torch.float64).to(device)
                              for n in (finite_samples, samples)])
        if allow_nonfinite:
            prev = self.prev_sums if self.prev_sums is not None else torch.zeros_like(counts)
            prev = torch.where(counts[1] >= prev[1], prev, 0.0)  # the counts restarted with a new epoch
            self.prev_sums = counts.clone()
            finite, count = counts - prev
            diverged = finite < 0.5 * count
        else:
            diverged = counts[0] < counts[1]
        flags = torch.stack([torch.full((), float(self.requested_here()), device=device),
                             diverged.to(device=device, dtype=torch.float32)])
        stop, bad = all_reduce_max(flags).tolist()
        if bad and allow_nonfinite:
            raise UserError("the training loss was NaN or infinite in most fp16 steps since the last check: "
                            "training diverged, and stopped before saving; lower --base-lr, raise "
                            "--warmup-epochs or use --amp bf16, then run again to resume from the last "
                            "checkpoint")
        if bad:
            raise UserError("the training loss became NaN or infinite, so training stopped before saving "
                            "anything from it (the last checkpoint is intact): lower --base-lr or raise "
                            "--warmup-epochs")
        return bool(stop)


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


# ---------------------------------------------------------------- the tools' SIGTERM and Ctrl-C
# bench.py, preflight.py and plot.py stop at once on SIGTERM (a timeout, scancel, torchrun) and Ctrl-C,
# in one line. (train_ddp.py instead turns them into a checkpointed stop: StopRequest.)


def quiet_resource_tracker() -> None:
    """The DataLoader workers' forkserver starts multiprocessing's resource tracker. After an exit at
    once (a stop signal in a tool, a second Ctrl-C in training) it removes the semaphores the loader's queues
    leave, and warns about them after this process's last line. Its warning, not its cleanup, is turned off
    here, through the environment it starts with (so before the first worker)."""
    ours = "ignore:resource_tracker:UserWarning"
    current = os.environ.get("PYTHONWARNINGS", "")
    if ours not in current:
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [current, ours]))


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM (timeout, scancel, torchrun) or SIGINT (Ctrl-C), raised in the main thread."""


_stop = {"signum": None, "lock": threading.Lock()}


def catch_stop_signals(grace_s: float = 1.5) -> None:
    """SIGTERM and SIGINT raise StoppedBySignal in the main thread at its next Python instruction; once it (or
    whatever it became on the way out) leaves the script, sys.excepthook ends the process with one line and
    exit status 128 + signum (exit_stopped), after the `finally` blocks on the way (the process group, the
    DataLoader workers). A thread woken by the signal itself (signal.set_wakeup_fd) ends it the same way after
    `grace_s` if the main thread is held up, e.g. in a C call that waits for a peer which has already left.
    Forked processes (DataLoader workers) get the default handling back."""
    quiet_resource_tracker()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def on_signal(signum, frame):
        if _stop["signum"] is None:  # a second signal changes nothing: the thread below ends the process
            _stop["signum"] = signum
            # no DataLoader "worker killed" error on the way out
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            raise StoppedBySignal(signum)

    def backstop():
        while not (got := [s for s in os.read(read_fd, 64) if s in (signal.SIGTERM, signal.SIGINT)]):
            pass
        time.sleep(grace_s)
        exit_stopped(got[0], flush=False)  # the main thread may hold stdout's lock

    def in_child():
        with contextlib.suppress(ValueError):  # raised if not the main thread
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def excepthook(kind, value, tb, default=sys.excepthook):
        if _stop["signum"] is not None:
            exit_stopped(_stop["signum"])
        default(kind, value, tb)

    # a signal that lands in a __del__ is lost: the thread ends it
    def unraisable(info, default=sys.unraisablehook):
        if not isinstance(info.exc_value, StoppedBySignal):
            default(info)

    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    sys.excepthook, sys.unraisablehook = excepthook, unraisable
    os.register_at_fork(after_in_child=in_child)
    threading.Thread(target=backstop, name="stop-backstop", daemon=True).start()


def exit_stopped(signum: int, flush: bool = True) -> None:
    """`script: [rank r: ]stopped by SIGTERM` on stderr, once, then exit 128 + signum at once."""
    # the main thread or the backstop, whichever comes first; the other waits here for the exit
    with _stop["lock"]:
        for stream in (sys.stdout, sys.stderr) if flush else ():
            with contextlib.suppress(Exception):
                stream.flush()
        env = read_dist_env()
        rank = f"rank {env.rank}: " if env.world_size > 1 else ""
        os.write(2, (f"{os.path.basename(sys.argv[0])}: {rank}stopped by "
                     f"{signal.Signals(signum).name}\n").encode())
        # DataLoader workers still up would outlive this process by seconds
        mp = sys.modules.get("multiprocessing")
        children = mp.active_children() if mp else []
        for child in children:  # SIGKILL: the loader workers ignore SIGTERM (deaf_to_stop_signals)
            with contextlib.suppress(Exception):
                child.kill()
        for child in children:  # gone before we are, so nothing of ours outlives the exit line
            with contextlib.suppress(Exception):
                child.join(timeout=1.0)
        os._exit(128 + signum)
