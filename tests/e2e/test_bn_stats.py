"""machinery.bn_stats.recompute_bn_stats under DDP: every rank's shard, each sample weighted alike, the same on every
rank."""
import os
import sys

import torch

from support import launch_forked

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bn_stats  # noqa: E402

import dataset_utils as du  # noqa: E402


def test_recomputed_bn_stats_on_two_uneven_ranks_are_those_of_all_samples_on_every_rank(tmp_path):
    n, batch = 37, 5  # 19 and 18 samples: the ranks' shards and their last batches differ in size
    launch_forked([tmp_path, n, batch], nproc=2, script="tests/scripts/bn_stats.py")
    # the reference: the conv's outputs for all 37 images at once, their mean and variance
    with torch.no_grad():
        features = bn_stats.model()[0](
            du.Normalize(*bn_stats.NORMALIZE, torch.device("cpu"))(bn_stats.images(n)))
        x = features.double().transpose(0, 1).flatten(1)
        mean, var = x.mean(1), x.var(1)  # unbiased, as BatchNorm keeps it
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for stats in ranks:
        torch.testing.assert_close(stats["mean"].double(), mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats["var"].double(), var, rtol=1e-5, atol=1e-6)
    assert torch.equal(ranks[0]["mean"], ranks[1]["mean"]) and torch.equal(ranks[0]["var"], ranks[1]["var"])
    # Rank 0's shard alone (what torch.optim.swa_utils.update_bn keeps on each rank) is told apart at this
    # tolerance.
    shard = features[0::2].double().transpose(0, 1).flatten(1)
    assert not torch.allclose(shard.mean(1), mean, rtol=1e-5, atol=1e-6)
