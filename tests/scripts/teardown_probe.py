"""train_ddp.py as a user runs it (its own __main__), and on each rank two lines: how many DistributedDataParallel
models are still alive as it destroys the process group, and at exit (its last atexit handler, before the
interpreter's finalization). Each holds the process group; one freed later, during finalization, can abort the
process. TEARDOWN_PROBE_BUG=N: rank 0's Nth training loss raises a ValueError, as a bug in adapted code would.

    torchrun --standalone --nproc_per_node=2 teardown_probe.py TRAIN_DDP_FLAGS...
"""
import atexit
import gc
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def say_alive(when: str) -> None:
    alive = sum(issubclass(type(o), DDP) for o in gc.get_objects())  # without collecting: what the script left
    print(f"teardown probe: rank {RANK}: {alive} DDP models alive {when}", file=sys.stderr, flush=True)


destroy_process_group = dist.destroy_process_group


def say_then_destroy(*args, **kwargs):
    say_alive("at destroy_process_group")
    return destroy_process_group(*args, **kwargs)


dist.destroy_process_group = say_then_destroy
atexit.register(say_alive, "at exit")  # registered first: run last

if os.environ.get("TEARDOWN_PROBE_BUG") and RANK == 0:
    # torchrun's SIGTERM, sent once rank 1 has left (its peer gone), must not cut rank 0's exit short of its lines
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cross_entropy, calls = torch.nn.functional.cross_entropy, [0]

    def cross_entropy_with_a_bug(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(os.environ["TEARDOWN_PROBE_BUG"]):
            raise ValueError("teardown probe: a bug in the training step")
        return cross_entropy(*args, **kwargs)
    torch.nn.functional.cross_entropy = cross_entropy_with_a_bug

sys.argv = [os.path.join(ROOT, "train_ddp.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
