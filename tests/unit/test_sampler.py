"""Which samples each rank trains on (dataset_utils.ShardSampler, torch's DistributedSampler unpadded, one per
virtual rank, and StepSampler, a step's micro-batches) and how a step splits into micro-batches (deal_step,
step_split, config.accumulation_steps): exactly the order of the sampler before it (EpochSampler, commit 92a1a6a),
so its checkpoints resume bit-identically; every sample once per epoch on any world size, accumulation and resume
position, the sampler's keys agreeing with the sizes train_step splits by, and micro-batches that never exceed
--micro-batch."""
import itertools

import pytest
import torch

from torch.utils.data import DistributedSampler

from dataset_utils import ShardSampler, StepSampler, deal_step
from train_utils import accumulation_steps


def train_sampler(n, *, batch_size, rank, world_size, accum_steps=1, seed=0):
    """The training sampler as dataset_utils.build_loaders makes it: a DistributedSampler per virtual rank."""
    shards = [ShardSampler(DistributedSampler(range(n), num_replicas=world_size * accum_steps,
                                              rank=rank + k * world_size, shuffle=True, seed=seed))
              for k in range(accum_steps)]
    return StepSampler(shards, batch_size=batch_size)


def epoch_order(n, seed, epoch):
    """The epoch's order, as DistributedSampler makes it: randperm(seed + epoch)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def steps_of_92a1a6a(n, *, batch_size, rank, world_size, accum_steps, seed, epoch, start):
    """The keys per step of the sampler before DistributedSampler (dataset_utils.EpochSampler at commit 92a1a6a),
    frozen here: the epoch's order randperm(seed + epoch), steps of batch_size positions from `start`, and in each
    step micro-step k of `rank` takes positions rank + k x W, rank + k x W + W x A, ... of the step."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    v = world_size * accum_steps
    for first in range(start, n, batch_size):
        step = order[first:first + batch_size]
        yield [(epoch, step[i]) for k in range(accum_steps) for i in range(rank + k * world_size, len(step), v)]


EXACT_CASES = [(n, ws, accum, batch, start)
               for n in (577, 600, 601) for ws in (1, 2, 3, 4) for accum in (1, 2, 3)
               for batch in (ws * accum * 4, ws * accum * 16, 96)
               if batch % (ws * accum) == 0
               for start in (0, batch, 7 * batch, 64, 288, 90) if start < n]


@pytest.mark.quick
def test_the_samplers_deal_exactly_the_order_of_the_sampler_before_them():
    """World sizes 1 to 4, 1 to 3 micro-steps, 577, 600 and 601 samples (uneven last steps, ranks left empty),
    from the epoch's start and mid-epoch (at a step of this batch, or of another batch or world size): every
    rank's keys, step by step, are the 92a1a6a sampler's, so a checkpoint it wrote resumes to the same samples."""
    assert len(EXACT_CASES) > 500
    for n, ws, accum, batch, start in EXACT_CASES:
        for rank in range(ws):
            new = train_sampler(n, batch_size=batch, rank=rank, world_size=ws, accum_steps=accum, seed=5)
            for epoch in (1, 2):
                new.set_epoch(epoch)
                new.start_at(start)
                old = list(steps_of_92a1a6a(n, batch_size=batch, rank=rank, world_size=ws, accum_steps=accum,
                                            seed=5, epoch=epoch, start=start))
                assert list(new) == old and len(new) == len(old), (n, ws, accum, batch, start, rank, epoch)


@pytest.mark.quick
@pytest.mark.parametrize("n,ws,accum,batch,start", [(601, 2, 2, 64, 192), (577, 3, 1, 96, 90), (600, 4, 3, 96, 288),
                                                    (601, 1, 1, 16, 0)])
def test_set_epoch_then_start_at_deals_what_set_epoch_with_a_start_dealt_and_the_next_epoch_starts_afresh(
        n, ws, accum, batch, start):
    """The resume's own call: set_epoch(epoch) (torch's) then start_at(position, skipped=...) deals exactly the
    positions set_epoch(epoch, start=position, skipped=...) dealt until it was split in two (the 92a1a6a order,
    which the test above holds it to), and keeps the very list of skipped samples it is given (the loader adds
    to Progress.skipped through it); the next epoch's set_epoch alone deals all of that epoch, none skipped."""
    for rank in range(ws):
        s = train_sampler(n, batch_size=batch, rank=rank, world_size=ws, accum_steps=accum, seed=2)
        skipped = ["sample 3 (unreadable)"]
        s.set_epoch(1)
        s.start_at(start, skipped=skipped)
        before = list(steps_of_92a1a6a(n, batch_size=batch, rank=rank, world_size=ws, accum_steps=accum, seed=2,
                                       epoch=1, start=start))
        assert list(s) == before and len(s) == len(before) and s.skipped is skipped
        assert [sum(s.step_split(start + k * batch)[1]) for k in range(len(s))] == [len(keys) for keys in before]
        s.set_epoch(2)
        whole = list(steps_of_92a1a6a(n, batch_size=batch, rank=rank, world_size=ws, accum_steps=accum, seed=2,
                                      epoch=2, start=0))
        assert list(s) == whole and len(s) == len(whole) and s.skipped == [] and s.skipped is not skipped


@pytest.mark.parametrize("n,ws", [(577, 2), (600, 4), (601, 3), (5, 8), (0, 2)])
def test_the_test_shard_is_distributed_sampler_s_unshuffled_and_unpadded(n, ws):
    """Rank r scores r, r + W, ...: torch's shard, padding left off, so every image once over all ranks."""
    for rank in range(ws):
        shard = ShardSampler(DistributedSampler(range(n), num_replicas=ws, rank=rank, shuffle=False))
        assert list(shard) == list(range(rank, n, ws)) and len(shard) == len(range(rank, n, ws))
        torch_s = list(DistributedSampler(range(n), num_replicas=ws, rank=rank, shuffle=False)) if n else []
        assert torch_s[:len(shard)] == list(shard)  # torch's, the padding left off


@pytest.mark.quick
@pytest.mark.parametrize("first,second", [((2, 1, 48), (3, 1, 48)), ((3, 1, 48), (2, 1, 48)),
                                          ((4, 1, 48), (1, 1, 48)), ((2, 1, 64), (2, 1, 32)),
                                          ((2, 2, 64), (1, 1, 24)), ((1, 4, 32), (3, 2, 96)),
                                          ((2, 1, 2), (3, 1, 3))])
def test_sampler_resumed_on_another_world_size_or_batch_sees_the_rest_of_the_epoch(first, second):
    """(world size, accumulation steps, global batch) before and after a mid-epoch resume."""
    n, done_steps = 601, 5
    seen, position = [], done_steps * first[2]
    for (ws, accum, batch), begin in ((first, 0), (second, position)):
        shards, samplers = [], []
        for rank in range(ws):
            s = train_sampler(n, batch_size=batch, rank=rank, world_size=ws, accum_steps=accum, seed=3)
            s.set_epoch(7)
            s.start_at(begin)
            steps = list(s)
            assert len(steps) == len(s)
            shards.append(steps[:done_steps] if begin == 0 else steps)
            samplers.append(s)
            seen += [i for keys in shards[-1] for e, i in keys if e == 7]
        assert len({len(sh) for sh in shards}) == 1, "every rank takes the same number of steps"
        for k in range(len(shards[0])):  # the micro-batches train_step will split, the short last step's too
            assert ([len(sh[k]) for sh in shards]
                    == [sum(s.step_split(begin + k * batch)[1]) for s in samplers])
    # The first run's steps, then the rest of the epoch: every sample exactly once, nothing padded.
    assert sorted(seen) == list(range(n))


CASES = [(n, batch, ws, accum, start)
         for n, batch, ws, accum in itertools.product((1, 7, 64, 129, 601), (4, 12, 48, 64), (1, 2, 3, 4),
                                                      (1, 2, 4))
         if batch % (ws * accum) == 0
         for start in sorted({0, batch, 5 * batch, (n // batch) * batch}) if start < n]


def test_the_sampler_s_keys_per_step_agree_with_step_split_for_every_shape_of_run():
    """For each step, what rank r's sampler yields is exactly the micro-batches step_split (what
    train_step splits its batch by) says, in size, and in content: the positions deal_step deals to
    virtual ranks r, r + W, ... of that step of the epoch's order. Over all ranks a step is the epoch's
    next `batch` samples (fewer in the last, short step); steps with a micro-batch left empty included."""
    empty_seen = 0
    assert len(CASES) > 300
    for n, batch, ws, accum, start in CASES:
        order = epoch_order(n, seed=11, epoch=4)
        samplers = [train_sampler(n, batch_size=batch, rank=r, world_size=ws, accum_steps=accum, seed=11)
                    for r in range(ws)]
        per_rank = []
        for s in samplers:
            s.set_epoch(4)
            s.start_at(start)
            per_rank.append(list(s))
        case = (n, batch, ws, accum, start)
        assert (len({len(steps) for steps in per_rank}) == 1
                and len(per_rank[0]) == -(-(n - start) // batch)), case
        for k in range(len(per_rank[0])):
            position = start + k * batch
            step = order[position:position + batch]
            dealt = []
            for r, s in enumerate(samplers):
                step_samples, micro_sizes = s.step_split(position)
                assert step_samples == len(step), case
                keys = per_rank[r][k]
                assert len(keys) == sum(micro_sizes) and len(micro_sizes) == accum, case
                assert all(e == 4 for e, _ in keys), case
                want = [step[i] for micro in deal_step(step_samples, r, ws, accum) for i in micro]
                assert [i for _, i in keys] == want, case
                assert [len(m) for m in deal_step(step_samples, r, ws, accum)] == micro_sizes, case
                empty_seen += micro_sizes.count(0)
                dealt += want
            assert sorted(dealt) == sorted(step), case  # the step's samples, each once, over all ranks
    assert empty_seen > 0, "some cases must leave a rank (or a micro-step) nothing in the last step"


def test_a_last_step_that_leaves_a_rank_nothing_still_yields_a_step_on_every_rank():
    """577 samples in steps of 64 on 2 ranks: the last step holds 1 sample, so rank 1's share is empty,
    but it still takes that step (and joins the gradient all-reduce with zero)."""
    sizes = []
    for rank in range(2):
        s = train_sampler(577, batch_size=64, rank=rank, world_size=2, seed=0)
        s.set_epoch(1)
        steps = list(s)
        assert len(steps) == len(s) == 10
        sizes.append([len(keys) for keys in steps])
        assert s.step_split(576) == (1, [1 - rank])
    assert sizes == [[32] * 9 + [1], [32] * 9 + [0]]


@pytest.mark.parametrize("step_samples,ws,accum",
                         [(64, 2, 2), (45, 4, 1), (45, 1, 4), (1, 2, 2), (0, 3, 1), (13, 3, 2)])
def test_deal_step_splits_a_step_over_virtual_ranks_evenly_and_without_overlap(step_samples, ws, accum):
    """Virtual rank r + k x W takes every (W x A)-th position from r + k x W: together they cover the step
    once, and no two micro-batches differ by more than one sample."""
    ranges = {(r, k): micro
              for r in range(ws) for k, micro in enumerate(deal_step(step_samples, r, ws, accum))}
    positions = sorted(p for micro in ranges.values() for p in micro)
    assert positions == list(range(step_samples))
    sizes = [len(m) for m in ranges.values()]
    assert max(sizes) - min(sizes) <= 1
    for (r, k), micro in ranges.items():
        assert list(micro) == list(range(r + k * ws, step_samples, ws * accum))


@pytest.mark.parametrize("per_rank,micro,steps", [(32, 64, 1), (32, 32, 1), (32, 16, 2), (24, 10, 3),
                                                  (24, 7, 4), (30, 4, 10), (7, 3, 7), (32, None, 1)])
def test_accumulation_steps_are_the_fewest_that_split_the_rank_batch_into_equal_micro_batches(
        per_rank, micro, steps):
    assert accumulation_steps(per_rank, micro) == steps
    assert per_rank % steps == 0 and (micro is None or per_rank // steps <= micro)
    # The fewest: no smaller count splits the rank's batch equally under the cap.
    assert not any(per_rank % a == 0 and (micro is None or per_rank // a <= micro) for a in range(1, steps))
