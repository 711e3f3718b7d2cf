"""Launched by torchrun: tools.bn_stats.recompute_bn_stats on a conv -> BatchNorm model, each rank scoring its
shard (r, r + W, ...) of N images in batches of B, so the shards and the last batches are uneven.

Usage: bn_stats.py OUT_DIR N B [DEVICE]   (DEVICE: cpu, the default, with gloo; cuda: one GPU a rank, NCCL)
Each rank saves its BatchNorm's running mean and variance to OUT_DIR/rank<r>.pt."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

import dataset_utils as du  # noqa: E402
from tools.bn_stats import recompute_bn_stats  # noqa: E402
from train_ddp import init_distributed  # noqa: E402


def images(n: int) -> torch.Tensor:
    """The test's images, the same on every rank: uint8, 3 x 8 x 8, channel means far apart."""
    g = torch.Generator().manual_seed(7)
    return (torch.rand(n, 3, 8, 8, generator=g)
            * torch.tensor([60.0, 120.0, 250.0]).view(1, 3, 1, 1)).to(torch.uint8)


def model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())


NORMALIZE = ((0.2, 0.3, 0.5), (0.1, 0.2, 0.3))

if __name__ == "__main__":
    out, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    env = init_distributed(sys.argv[4] if len(sys.argv) > 4 else "cpu", timeout_s=60)
    shard = images(n)[env.rank::env.world_size]
    loader = [(x, None) for x in shard.split(batch)]
    net = model().to(env.device)
    recompute_bn_stats(net, loader, normalize=du.Normalize(*NORMALIZE, env.device))
    bn = net[1]
    torch.save({"mean": bn.running_mean.cpu(), "var": bn.running_var.cpu()}, os.path.join(out, f"rank{env.rank}.pt"))
    torch.distributed.destroy_process_group()
