"""DataLoader workers: forked by a forkserver per rank (forking a rank can hang), dying with it."""
import atexit
import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from multiprocessing import connection, resource_tracker

from machinery.errors import UserError
from machinery.signals import STOP_SIGNALS

RANK_PID = "DDP_LOADER_RANK_PID"  # the rank's pid, which its forkserver checks
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103  # a socket's sun_path, less its NUL


def check_worker_sockets(workers: int) -> None:
    path = os.fsencode(connection.arbitrary_address("AF_UNIX")) if workers else b""  # the forkserver's
    if len(path) > SOCKET_PATH_MAX:
        folder = os.path.dirname(os.path.dirname(path))  # the socket is <TMPDIR>/pymp-XXXXXXXX/<name>
        raise UserError(f"TMPDIR {os.fsdecode(folder)} ({len(folder)} bytes) is too long for the DataLoader "
                        f"workers' socket in it ({len(path)} bytes, over {SOCKET_PATH_MAX}): set TMPDIR to at most "
                        f"{SOCKET_PATH_MAX - len(path) + len(folder)} bytes (export TMPDIR=/tmp) or use --workers 0")


def worker_context():
    """The forkserver's, preloading torch and this module (`__main__` fails before cpython#126631)."""
    os.environ[RANK_PID] = str(os.getpid())
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", "torchvision", __name__])
    return context


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (or now): a killed rank's workers would live on."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def stop_signals_held():
    """Stop signals held as workers start (and in them): Slurm signals all; a rank saves first."""
    atexit.unregister(end_workers_at_exit)
    atexit.register(end_workers_at_exit)  # to run before multiprocessing's own
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()  # its start unblocks SIGINT and SIGTERM: hold them again
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_workers(loader):
    """iter(loader) with the stop signals held; a Dataset that does not pickle: UserError."""
    try:
        with stop_signals_held():
            return iter(loader)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        if "pickle" not in str(e):
            raise
        raise UserError(f"load_data's {type(loader.dataset.data).__name__} cannot be sent to the DataLoader "
                        f"workers ({str(e).splitlines()[0]}): make its class top-level, or use --workers 0") from None


def end_workers_at_exit() -> None:
    """SIGKILL workers at exit: multiprocessing would SIGTERM them (ignored) and wait for ever."""
    children = multiprocessing.active_children()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # without torch's "worker killed" error
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)


def deaf_to_stop_signals(worker_id: int = 0) -> None:
    """A worker's worker_init_fn: stop signals ignored (the rank stops it), then unblocked."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    default = sys.excepthook
    sharer = os.path.join("multiprocessing", "resource_sharer.py")
    def quiet_when_rank_leaves(kind, value, tb) -> None:  # a rank left mid-batch: no resource_sharer traceback
        if not (issubclass(kind, (EOFError, OSError, multiprocessing.AuthenticationError))
                and any(frame.f_code.co_filename.endswith(sharer) for frame, _ in traceback.walk_tb(tb))):
            default(kind, value, tb)
    sys.excepthook = quiet_when_rank_leaves


# In a rank's forkserver (`python -c`), on Linux: it and its workers die with the rank.
if sys.argv[:1] == ["-c"] and os.environ.pop(RANK_PID, None) == str(os.getppid()) and sys.platform == "linux":
    die_with_parent(os.getppid())
    os.register_at_fork(after_in_child=lambda forkserver=os.getpid(): die_with_parent(forkserver))
