"""DataLoader workers: forked by multiprocessing's forkserver (one per rank: a fork of a rank while its process
group's threads run can hang the child), which imports torch first and dies, with its workers, with its rank; the
workers hold, then ignore, the stop signals. Imported where workers start (dataset_utils)."""
import atexit
import contextlib
import ctypes
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import traceback
from multiprocessing import resource_tracker

from machinery.errors import UserError
from machinery.signals import STOP_SIGNALS

RANK_PID = "DDP_LOADER_RANK_PID"  # the starting rank's pid, for the forkserver to tell it is that rank's child
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# A Unix socket's longest path: sun_path less its closing zero (108 bytes on Linux, 104 on macOS and the BSDs).
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103


def check_worker_sockets(workers: int) -> None:
    """UserError if the loader workers' forkserver socket in TMPDIR would have a path over SOCKET_PATH_MAX bytes."""
    if not workers:
        return
    path = os.fsencode(multiprocessing.connection.arbitrary_address("AF_UNIX"))  # as the forkserver names it
    if len(path) > SOCKET_PATH_MAX:
        folder = os.path.dirname(os.path.dirname(path))  # the socket is <TMPDIR>/pymp-XXXXXXXX/<name>
        fits = SOCKET_PATH_MAX - (len(path) - len(folder))
        raise UserError(f"the temporary folder {os.fsdecode(folder)} (TMPDIR, {len(folder)} bytes) is too long "
                        f"a path for the DataLoader workers' socket in it ({len(path)} bytes; a socket takes "
                        f"{SOCKET_PATH_MAX}, so TMPDIR at most {fits}): set TMPDIR to a shorter folder (export "
                        f"TMPDIR=/tmp) or run with --workers 0")



def worker_context():
    """The forkserver's context, told to import torch before forking workers. Its default preload, `__main__`, never
    happens on Pythons without python/cpython#126631's fix (3.11, 3.12 among them): each worker runs the script again
    and, without this, imports torch itself (2-3 CPU-seconds a worker, at every loader start). Preloading this module
    ties the forkserver's life to the rank's and the workers' to the forkserver's (die_with_parent)."""
    os.environ[RANK_PID] = str(os.getpid())
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", "torchvision", __name__])
    return context


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (Linux: PR_SET_PDEATHSIG), and now if it already has.
    Workers ignore stop signals and their parent is the forkserver, so DataLoader's rank-alive check never fires: a
    SIGKILLed rank (OOM killer, Slurm after KillWait, kill -9) would leave forkserver and workers holding memory for
    ever. Linux ties it to the thread that started the forkserver: the rank's main thread (makes the first iterator)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


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


def start_workers(loader):
    """iter(loader) with the stop signals held: the workers start there (once: they persist) and get the Dataset
    pickled; one they cannot take is a UserError naming the ways out."""
    try:
        with stop_signals_held():
            return iter(loader)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        if "pickle" not in str(e):
            raise
        raise UserError(f"load_data's {type(loader.dataset.data).__name__} cannot be sent to the DataLoader workers "
                        f"({str(e).splitlines()[0]}): define its class at the top level of a module, not inside a "
                        f"function, or use --workers 0") from None


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
    """A loader worker's worker_init_fn: ignore the stop signals, then unblock them (those held are discarded); and
    a rank that leaves mid-batch is no error of the worker's (quiet_when_rank_leaves)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    sys.excepthook = functools.partial(quiet_when_rank_leaves, default=sys.excepthook)


def quiet_when_rank_leaves(kind, value, tb, default) -> None:
    """A worker's batches reach its rank as file descriptors, handed over by multiprocessing's resource_sharer
    thread after a handshake. A rank that leaves mid-handshake (a tool ended at once by Ctrl-C or SIGTERM) breaks
    it, and that thread would print a traceback through sys.excepthook before the rank's own one line: not here."""
    sharer = os.path.join("multiprocessing", "resource_sharer.py")
    if (issubclass(kind, (EOFError, OSError, multiprocessing.AuthenticationError))
            and any(frame.f_code.co_filename.endswith(sharer) for frame, _ in traceback.walk_tb(tb))):
        return
    default(kind, value, tb)


# In a rank's forkserver (worker_context's preload; started with `python -c`): it and each worker it forks die with
# their parent. Imported anywhere else (the rank, a tool, a process the rank starts), this does nothing.
if sys.argv[:1] == ["-c"] and os.environ.pop(RANK_PID, None) == str(os.getppid()):
    die_with_parent(os.getppid())
    _forkserver = os.getpid()
    os.register_at_fork(after_in_child=lambda: die_with_parent(_forkserver))
