"""DataLoader workers: forked by multiprocessing's forkserver (one per rank: a fork of a rank while its process
group's threads run can hang the child), which imports torch first and dies, with its workers, with its rank."""
import ctypes
import multiprocessing
import os
import signal
import sys

RANK_PID = "DDP_LOADER_RANK_PID"  # the starting rank's pid, for the forkserver to tell it is that rank's child
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_context():
    """The forkserver's context, told to import torch before forking workers. Its default preload, `__main__`, never
    happens on Pythons without python/cpython#126631's fix (3.11, 3.12 among them): each worker runs the script again
    and, without this, imports torch itself (2-3 CPU-seconds a worker, at every loader start). Preloading this module
    ties the forkserver's life to the rank's and the workers' to the forkserver's (die_with_parent)."""
    os.environ[RANK_PID] = str(os.getpid())
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", __name__])
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


# In a rank's forkserver (worker_context's preload; started with `python -c`): it and each worker it forks die with
# their parent. Imported anywhere else (the rank, a tool, a process the rank starts), this does nothing.
if sys.argv[:1] == ["-c"] and os.environ.pop(RANK_PID, None) == str(os.getppid()):
    die_with_parent(os.getppid())
    _forkserver = os.getpid()
    os.register_at_fork(after_in_child=lambda: die_with_parent(_forkserver))
