"""The slow-rank line (machinery.timing.find_slow_rank): a rank is named when its own time per step (all
but waiting on the others) exceeds the median of the other ranks' by more than 10% (with two ranks, the
other's) and by a second or more over the epoch, with the phase that makes most of the difference; waiting
(sync) never makes a rank slow. The input-bound line (find_input_bound): a rank waiting for data most of its step."""
import pytest
import torch

from machinery.timing import (INPUT_BOUND_SHARE, PHASES, SLOW_RANK_FLOOR_S, SLOW_RANK_THRESHOLD, StepLog,
                              find_input_bound, find_slow_rank)


def rank(r, host="node1", steps=400, **seconds):
    split = {f"{p}_s": seconds.get(p, 0.0) for p in PHASES}
    return {"rank": r, "host": host, "steps": steps, "step_s": sum(split.values()), **split}


def test_the_threshold_is_ten_percent():
    assert SLOW_RANK_THRESHOLD == 0.10


def test_balanced_ranks_name_no_one():
    ranks = [rank(r, data=0.01, compute=0.10 + 0.002 * r, sync=0.02, optimizer=0.01) for r in range(4)]
    assert find_slow_rank(ranks) is None


def test_a_rank_waiting_for_data_is_named_with_its_host_and_share():
    ranks = [rank(r, data=0.01, compute=0.1, sync=0.05, optimizer=0.01) for r in range(4)]
    # the others wait for it
    ranks[3] = rank(3, host="node2", data=0.06, compute=0.1, sync=0.0, optimizer=0.01)
    line = find_slow_rank(ranks)
    assert line == ("rank 3 on node2: 42% slower than the other ranks' median, 35% of its step waiting "
                    "for data")


def test_a_rank_slow_in_forward_and_backward_is_named_for_it():
    ranks = [rank(r, data=0.01, compute=0.1, sync=0.03, optimizer=0.01) for r in range(3)]
    ranks[0] = rank(0, data=0.01, compute=0.13, sync=0.0, optimizer=0.01)
    assert find_slow_rank(ranks).startswith("rank 0 on node1: 25% slower than the other ranks' median") \
        and find_slow_rank(ranks).endswith("of its step in forward and backward")


@pytest.mark.parametrize("extra,named", [(0.009, False), (0.013, True)])  # 9% and 13% over the median's 0.1
def test_only_more_than_the_threshold_names_a_rank(extra, named):
    ranks = [rank(r, compute=0.1) for r in range(3)] + [rank(3, compute=0.1 + extra)]
    assert (find_slow_rank(ranks) is not None) == named


def test_with_two_ranks_the_slower_is_compared_with_the_other():
    assert find_slow_rank([rank(0, compute=0.1), rank(1, compute=0.109)]) is None
    assert find_slow_rank([rank(0, compute=0.1), rank(1, compute=0.113)]).startswith(
        "rank 1 on node1: 13% slower")


def test_a_short_epoch_whose_slow_rank_costs_less_than_a_second_names_no_one():
    assert SLOW_RANK_FLOOR_S == 1.0
    # 13% slower, as on a 1.5-second CPU epoch: 10 steps x 13 ms = 0.13 s lost, nothing to act on.
    assert find_slow_rank([rank(0, steps=10, compute=0.1), rank(1, steps=10, compute=0.113)]) is None
    # The same share over 100 steps is 1.3 s an epoch: named.
    assert find_slow_rank([rank(0, steps=100, compute=0.1), rank(1, steps=100, compute=0.113)]) is not None


def test_waiting_on_the_others_never_makes_a_rank_slow_and_one_rank_has_no_peers():
    ranks = [rank(0, compute=0.1, sync=0.5), rank(1, compute=0.1)]
    assert find_slow_rank(ranks) is None
    assert find_slow_rank([rank(0, data=1.0)]) is None


def test_the_run_eta_is_the_epochs_left_at_this_session_s_pace_in_plain_units():
    from machinery.records import describe_run_eta
    assert describe_run_eta(1, 100, 55.0).startswith("Run: 1 of 100 epochs done; about 1 h 31 min left (ends "
                                                     "about ")
    assert describe_run_eta(3, 5, 20.0).startswith("Run: 3 of 5 epochs done; about 1 min left")
    assert describe_run_eta(1, 2, 0.4).startswith("Run: 1 of 2 epochs done; about 1 s left")
    assert describe_run_eta(1, 200, 3600.0).startswith("Run: 1 of 200 epochs done; about 199 h 0 min left "
                                                       "(ends about ")


class Clock:
    """time.perf_counter as the test sets it."""
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    import machinery.timing
    clock = Clock()
    monkeypatch.setattr(machinery.timing.time, "perf_counter", clock)
    monkeypatch.setenv("RANK", "0")
    return clock


def sums(loss=1.0):
    """What the recipe passes: the epoch's loss sum so far and its sample count."""
    return (loss, 1.0)

def test_the_eta_leaves_out_the_first_step_s_start_up_and_the_first_line_says_so(clock, capsys):
    """A first step of 100 s (start-up), then 1 s a step: the ETA is 1 s a step, not 104 s over 5."""
    lines = StepLog(4, torch.device("cpu"), epochs=3)
    lines.mark("start")
    clock.now = 100.0
    lines.update(1, 1, 10, 32, sums(), t0=0.0)
    for step in range(2, 6):
        clock.now += 1.0
        lines.update(1, step, 10, 32 * step, sums(), t0=0.0)
    out = capsys.readouterr().out.splitlines()
    assert out == ["  epoch 1 step 1/10 | 0 img/s | loss 1.0000 | ETA: from the next steps' pace (this one "
                   "carries the start-up)",
                   # 5 steps left, then 2 epochs of 10 steps
                   "  epoch 1 step 4/10 | 32 img/s | loss 1.0000 | epoch ETA 6 s | run ETA 26 s"]


def test_the_progress_line_s_run_eta_is_this_epoch_s_rest_then_each_epoch_left_with_its_evaluation(
        clock, capsys):
    lines = StepLog(5, torch.device("cpu"), epochs=3)
    for epoch in (1, 2):
        lines.mark("start")
        for step in range(1, 6):  # 1 s a step
            clock.now += 1.0
            lines.update(epoch, step, 10, 32 * step, sums(), t0=0.0)
        clock.now += 5.0  # the rest of the epoch
        lines.mark("end")
        clock.now += 4.0  # its evaluation and checkpoint took 4 s
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "  epoch 1 step 5/10 | 32 img/s | loss 1.0000 | epoch ETA 5 s | run ETA 25 s"
    # 5 + 4, then 1 epoch of 10 + 4
    assert out[-1] == "  epoch 2 step 5/10 | 32 img/s | loss 1.0000 | epoch ETA 5 s | run ETA 23 s"


def test_a_rank_waiting_for_data_most_of_its_step_and_a_second_an_epoch_is_named_with_the_median_rank_s_share():
    """More than half of a rank's step waiting for data, and a second or more over the epoch: the line names it
    with the median rank's share; less of either, none. (The epoch with the start-up is left out by
    StepLog.finish_epoch: e2e/test_diagnostics.py's slow-data test.)"""
    assert INPUT_BOUND_SHARE == 0.5
    ranks = [rank(r, data=0.02, compute=0.1, optimizer=0.01) for r in range(3)]
    assert find_input_bound(ranks) is None
    ranks[2] = rank(2, host="node2", data=0.3, compute=0.1, optimizer=0.01)
    assert find_input_bound(ranks) == "rank 2 on node2 waited for data 73% of its step (the median rank: 15%)"
    assert find_input_bound([rank(0, data=0.12, compute=0.1)]).startswith("rank 0 on node1 waited for data 55%")
    assert find_input_bound([rank(0, data=0.1, compute=0.1)]) is None  # half: not most
    assert find_input_bound([rank(0, steps=4, data=0.2, compute=0.1)]) is None  # 0.8 s an epoch: noise
