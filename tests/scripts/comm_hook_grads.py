"""DDP's gradients under --comm-hook fp16, against what the hook promises: tests/e2e/test_comm_hooks.py. On each of
the ranks (torchrun's environment, gloo), a small conv net gets a batch of its own; the gradients DDP leaves after
backward are compared with the mean of every rank's own gradients (from a replica without DDP), fp16-rounded as the
hook rounds them, and with the fp32 mean. Rank 0 prints one JSON line."""
import copy
import gc
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, sys.argv[1])  # the project
import train_ddp  # noqa: E402
from train_utils import get_args_parser, make_config  # noqa: E402
from machinery.launch import read_launcher  # noqa: E402
from machinery.timing import StepLog  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
env = read_launcher("cpu")
cfg = make_config(get_args_parser().parse_args(["--comm-hook", "fp16", "--device", "cpu"]), env)
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
replica = copy.deepcopy(net)
ddp = train_ddp.wrap_ddp(net, cfg, env, StepLog(0, torch.device("cpu"), timed=False))
torch.manual_seed(1 + rank)  # a batch of this rank's own
x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
nn.functional.cross_entropy(replica(x), y).backward()
nn.functional.cross_entropy(ddp(x), y).backward()
mine = [p.grad for p in replica.parameters()]
everyone = [[torch.zeros_like(g) for _ in range(world)] for g in mine]
for gathered, g in zip(everyone, mine):
    dist.all_gather(gathered, g)
rounded_mean, fp32_mean = [], []
for gathered in everyone:
    total = torch.zeros_like(gathered[0], dtype=torch.float16)
    for g in gathered:  # fp16_compress_hook: each rank's bucket to fp16, divided by the world size, summed in fp16
        total = total + g.to(torch.float16) / world
    rounded_mean.append(total.float())
    fp32_mean.append(sum(gathered) / world)
got = [p.grad for p in ddp.module.parameters()]
if rank == 0:
    print(json.dumps({"equals_rounded_mean": all(torch.equal(a, b) for a, b in zip(got, rounded_mean)),
                      "equals_fp32_mean": all(torch.equal(a, b) for a, b in zip(got, fp32_mean)),
                      "largest_difference_from_fp32": max((a - b).abs().max().item()
                                                          for a, b in zip(got, fp32_mean))}))
del ddp  # freed before its process group, as train_ddp.main's teardown has it: after, at exit, it can abort
gc.collect()
dist.destroy_process_group()
