"""How the DataLoader workers start, and that they end with their rank: forked by multiprocessing's forkserver
(a fresh process per rank, since a fork of a rank while its process group's threads run can hang the child),
which imports torch before it forks them, and which, with its workers, dies with the rank that started it."""
import ctypes
import multiprocessing
import os
import signal
import sys

# The pid of the rank that starts the forkserver, for the forkserver to tell that it is that rank's child.
RANK_PID = "DDP_LOADER_RANK_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_context():
    """The forkserver's context, told to import torch before it forks the workers. Its default is to import
    the script (`__main__`), but on Pythons without the fix of python/cpython#126631 (3.11 and 3.12 among them)
    that never happens: each worker runs the script again, and without this imported torch itself too (2 to 3
    CPU-seconds a worker, at every loader's start); now it finds torch imported. It imports this module too,
    which ties the forkserver's life to the rank's and the workers' to the forkserver's (die_with_parent)."""
    os.environ[RANK_PID] = str(os.getpid())
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", __name__])
    return context


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (Linux: PR_SET_PDEATHSIG), and now if it already has.

    The workers ignore the stop signals (the rank alone decides when to stop), and their parent is the
    forkserver, not the rank, so DataLoader's own check that its rank lives never fires: without this, a rank
    killed by SIGKILL (the OOM killer, Slurm after KillWait, kill -9) would leave its forkserver and workers
    running, each holding its memory, for ever. (Linux ties it to the thread that started the forkserver: the
    rank's main thread, which makes the loaders' first iterator.)"""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


# Imported by the forkserver of a rank (worker_context's preload list; multiprocessing starts it with
# `python -c`): it dies with the rank, and each worker it forks dies with it. Imported anywhere else (the rank,
# a tool, a process the rank starts), this does nothing.
if sys.argv[:1] == ["-c"] and os.environ.pop(RANK_PID, None) == str(os.getppid()):
    die_with_parent(os.getppid())
    _forkserver = os.getpid()
    os.register_at_fork(after_in_child=lambda: die_with_parent(_forkserver))
