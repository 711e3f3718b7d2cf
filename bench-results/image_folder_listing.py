"""The README's image-folder load_data on every rank of one torchrun job: the os.scandir calls and the files opened
under the data dir, summed over the ranks, and each rank's seconds. Run it on two trees to compare them:

    torchrun --standalone --nproc_per_node=4 bench-results/image_folder_listing.py <project tree> <data dir>
"""
import os
import sys
import time
import types

tree, data_dir = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
sys.path.insert(0, tree)
import torch.distributed as dist  # noqa: E402

import dataset_utils  # noqa: E402  (the tree's)

dist.init_process_group("gloo")
with open(os.path.join(tree, "README.md")) as f:
    block = f.read().split("<!-- image folders: the tests replace load_data with exactly this block -->", 1)[1]
scope = {"dataset_utils": dataset_utils}
exec(block.split("```python\n", 1)[1].split("```", 1)[0], scope)  # the README's load_data, as written there
counts = {"scandir": 0, "opened": 0}


def count(event, args):
    if event == "os.scandir":
        counts["scandir"] += 1
    elif event == "open" and isinstance(args[0], str) and args[0].startswith(data_dir):
        counts["opened"] += 1


sys.addaudithook(count)
rank = dist.get_rank()
env = types.SimpleNamespace(rank=rank, local_rank=0, world_size=dist.get_world_size(), is_main=rank == 0)
dist.barrier()
start = time.perf_counter()
scope["load_data"](types.SimpleNamespace(data_dir=data_dir), env)
ranks = [None] * dist.get_world_size()
dist.all_gather_object(ranks, (dict(counts), time.perf_counter() - start))
if rank == 0:
    print(f"{tree}, {len(ranks)} ranks: os.scandir {sum(c['scandir'] for c, _ in ranks)} "
          f"({[c['scandir'] for c, _ in ranks]} by rank), files opened {sum(c['opened'] for c, _ in ranks)}, "
          f"seconds by rank {[round(s, 2) for _, s in ranks]}")
dist.destroy_process_group()
