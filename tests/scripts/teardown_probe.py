"""train_ddp.py as a user runs it (its own __main__), and on each rank, as it destroys the process group, one line:
how many DistributedDataParallel models are still alive there. Each holds the process group; one freed later, at
the interpreter's exit, can abort the process.

    torchrun --standalone --nproc_per_node=2 teardown_probe.py TRAIN_DDP_FLAGS...
"""
import gc
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

destroy_process_group = dist.destroy_process_group


def count_then_destroy(*args, **kwargs):
    alive = sum(issubclass(type(o), DDP) for o in gc.get_objects())  # without collecting: what the script left
    print(f"teardown probe: rank {dist.get_rank()}: {alive} DDP models alive at destroy_process_group",
          file=sys.stderr, flush=True)
    return destroy_process_group(*args, **kwargs)


dist.destroy_process_group = count_then_destroy
sys.argv = [os.path.join(ROOT, "train_ddp.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
