"""The LR: the scaling rule that carries --base-lr from --reference-batch-size to the global batch
(config.scaled_lr: linear, sqrt, none), and the schedule's factor of that peak for each step
(train_utils.lr_factor): a linear warm-up measured at the step's end, then cosine to 0 or the WRN
paper's x0.2 steps at 30%, 60% and 80% of training, counted in samples so that the batch size does
not move it."""
import math

import pytest

from train_utils import scaled_lr
from train_utils import lr_factor


@pytest.mark.parametrize("rule,batch,reference,expected", [
    ("linear", 512, 128, 0.4), ("linear", 1024, 128, 0.8), ("linear", 64, 128, 0.05),
    ("linear", 128, 128, 0.1),
    ("sqrt", 512, 128, 0.2), ("sqrt", 32, 128, 0.05), ("sqrt", 256, 128, 0.1 * math.sqrt(2)),
    ("none", 512, 128, 0.1), ("none", 32, 128, 0.1),
])
def test_the_lr_rule_scales_the_base_lr_by_the_batch_ratio_its_square_root_or_not_at_all(
        rule, batch, reference, expected):
    assert scaled_lr(0.1, batch, reference, rule) == pytest.approx(expected, rel=1e-12)


def factors(n, batch, epochs, warmup, schedule):
    """Each step's (start, end, factor) over a whole run of `n` samples per epoch, the start and end in
    epochs done, as train_one_epoch computes them (the epoch's last step may be short)."""
    out = []
    for epoch in range(1, epochs + 1):
        for position in range(0, n, batch):
            start, end = epoch - 1 + position / n, epoch - 1 + min(position + batch, n) / n
            out.append((start, end,
                        lr_factor(start, end, epochs=epochs, warmup_epochs=warmup, schedule=schedule)))
    return out


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_warm_up_rises_linearly_from_near_0_to_1_at_warmup_epochs_measured_at_each_step_s_end(schedule):
    steps = factors(n=1000, batch=100, epochs=10, warmup=2, schedule=schedule)  # 10 steps per epoch
    warm = [(s, e, f) for s, e, f in steps if s < 2]
    assert len(warm) == 20
    # linear in the samples seen by its end
    assert all(f == pytest.approx(e / 2, rel=1e-12) for s, e, f in warm)
    assert warm[0][2] == pytest.approx(0.05)  # the first step: a 20th of the peak, not 0 (a wasted step)
    assert warm[-1][1] == 2 and warm[-1][2] == 1.0  # the step that ends at warmup_epochs reaches the peak
    assert all(a[2] < b[2] for a, b in zip(warm, warm[1:]))  # rising all the way
    assert steps[20][0] == 2 and steps[20][2] == 1.0  # the first step after warm-up: the schedule's start, 1
    # A warm-up that ends mid-epoch, and a short last step: still the end's fraction, never above 1.
    assert lr_factor(0.0, 0.3, epochs=5, warmup_epochs=0.5, schedule=schedule) == pytest.approx(0.6)
    assert lr_factor(0.4, 0.6, epochs=5, warmup_epochs=0.5, schedule=schedule) == 1.0


def test_cosine_is_1_after_warm_up_half_at_the_midpoint_and_reaches_0_at_the_end():
    kw = dict(epochs=10, warmup_epochs=2, schedule="cosine")
    assert lr_factor(2.0, 2.1, **kw) == 1.0  # right after warm-up
    assert lr_factor(6.0, 6.1, **kw) == pytest.approx(0.5, abs=1e-12)  # the midpoint of epochs 2..10
    assert lr_factor(4.0, 4.1, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)), abs=1e-12)
    assert lr_factor(10.0, 10.0, **kw) == pytest.approx(0.0, abs=1e-12)  # the end of training
    steps = factors(n=1000, batch=100, epochs=10, warmup=2, schedule="cosine")
    post = [f for s, e, f in steps if s >= 2]
    assert all(a > b for a, b in zip(post, post[1:]))  # falling all the way
    assert 0 < post[-1] < 1e-3  # the last step starts 0.1 epoch before the end: cos near its end
    # Without warm-up it starts at 1 at once.
    assert lr_factor(0.0, 0.1, epochs=10, warmup_epochs=0, schedule="cosine") == 1.0


def test_step_schedule_multiplies_by_0_2_exactly_at_30_60_and_80_percent_of_training():
    """The recipe's 200 epochs: x0.2 from epoch 60, 120 and 160 on (the WRN paper's), to 0.2, 0.04, 0.008."""
    kw = dict(epochs=200, warmup_epochs=5, schedule="step")
    for start, expected in [(5.0, 1.0), (59.999, 1.0), (60.0, 0.2), (119.999, 0.2), (120.0, 0.04),
                            (159.999, 0.04), (160.0, 0.008), (199.99, 0.008)]:
        assert lr_factor(start, start + 0.001, **kw) == pytest.approx(expected, rel=1e-12), start
    # On a whole run of 10 epochs: 1 for epochs 1-3, then 0.2 for 4-6, 0.04 for 7-8, 0.008 for 9-10.
    steps = factors(n=500, batch=100, epochs=10, warmup=0, schedule="step")
    by_epoch = {}
    for s, e, f in steps:
        by_epoch.setdefault(int(s) + 1, set()).add(round(f, 12))
    assert by_epoch == {1: {1.0}, 2: {1.0}, 3: {1.0}, 4: {0.2}, 5: {0.2}, 6: {0.2}, 7: {0.04}, 8: {0.04},
                        9: {0.008}, 10: {0.008}}


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_the_schedule_is_counted_in_samples_so_the_batch_size_does_not_move_it(schedule):
    """A step's factor after warm-up is decided by where it starts in the samples (not by its number,
    nor by its end): steps of any batch size that start at the same sample get the same factor. The
    step schedule's drop comes with the first step that starts at or after the milestone's sample,
    within one step of it whatever the batch."""
    n, epochs, warmup = 960, 7, 1  # the milestones, 2.1, 4.2 and 5.6 epochs, fall inside epochs
    runs = {batch: factors(n, batch, epochs, warmup, schedule) for batch in (32, 96, 320)}
    fine = {round(s, 12): f for s, e, f in runs[32] if s >= warmup}
    for batch in (96, 320):
        for s, e, f in runs[batch]:
            if s >= warmup:
                # 32 divides 96 and 320: each start is one of batch 32's
                assert f == fine[round(s, 12)], (batch, s)
    if schedule == "step":
        for batch, steps in runs.items():
            for milestone, level in ((0.3 * epochs, 0.2), (0.6 * epochs, 0.04), (0.8 * epochs, 0.008)):
                first = next(s for s, e, f in steps if s >= warmup and f < level * 1.0001)
                assert milestone - 1e-9 <= first <= milestone + batch / n, (batch, milestone, first)
        # A step that straddles a milestone keeps its start's factor, whichever its end.
        assert lr_factor(2.09, 2.5, epochs=epochs, warmup_epochs=warmup, schedule="step") == 1.0


@pytest.mark.parametrize("epochs,n,batch", [
    (10, 1000, 100), (200, 50_000, 500),  # milestones at epoch starts (the recipe's 60, 120, 160)
    (7, 960, 96),  # milestones mid-epoch
])
def test_the_step_that_starts_exactly_at_a_milestone_is_the_first_to_drop(epochs, n, batch):
    """At 30%, 60% and 80% of training's samples: the step that starts there has the lower factor, the
    step before it the higher one."""
    steps = factors(n, batch, epochs, warmup=1, schedule="step")
    for k, (fraction, before, after) in enumerate(((0.3, 1.0, 0.2), (0.6, 0.2, 0.04), (0.8, 0.04, 0.008))):
        at = round(fraction * epochs * n)  # the milestone, in samples
        assert at % batch == 0 and (at % n) % batch == 0  # a step starts there (the cases are chosen so)
        i = at // n * -(-n // batch) + (at % n) // batch  # that step's index in the run
        assert steps[i][0] == pytest.approx(fraction * epochs, abs=1e-12)
        assert steps[i - 1][2] == pytest.approx(before, rel=1e-12), (fraction, steps[i - 1])
        assert steps[i][2] == pytest.approx(after, rel=1e-12), (fraction, steps[i])


def test_constant_schedule_keeps_the_peak_after_warm_up_and_without_warm_up_from_the_first_step():
    """The original script's constant LR: 1 from the first step without warm-up, and after a warm-up."""
    assert {lr_factor(s, s + 0.01, epochs=10, warmup_epochs=0, schedule="constant")
            for s in (0.0, 3.5, 9.99)} == {1.0}
    assert lr_factor(0.0, 0.5, epochs=10, warmup_epochs=1, schedule="constant") == 0.5
    assert lr_factor(1.0, 1.5, epochs=10, warmup_epochs=1, schedule="constant") == 1.0
