"""How the DataLoader workers start: forked by multiprocessing's forkserver (a fresh process per rank, since a
fork of a rank while its process group's threads run can hang the child), which imports torch before it forks
them."""
import multiprocessing


def worker_context():
    """The forkserver's context, told to import torch before it forks the workers. Its default is to import
    the script (`__main__`), but on Pythons without the fix of python/cpython#126631 (3.11 and 3.12 among them)
    that never happens: each worker runs the script again, and without this imported torch itself too (2 to 3
    CPU-seconds a worker, at every loader's start); now it finds torch imported."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch"])
    return context
