"""What the ranks' time splits (timing.StepLog.finish_epoch's, at each epoch's end) say, where it matters: the rank
that held the others back, and a rank whose loader does not keep up. Loaded at the first epoch's end."""
from __future__ import annotations

import statistics

from machinery.phases import PHASES

# A rank is named when its own time per step (all but sync) exceeds the other ranks' median by more than this:
# below 10% it costs the job under a tenth of its speed, and ranks differ by a few percent per epoch anyway.
SLOW_RANK_THRESHOLD = 0.10
SLOW_RANK_FLOOR_S = 1.0  # ... and by at least this many seconds an epoch: less is noise the user cannot act on
# Training says the loader does not keep up when a rank waits for data more than this share of its step, by at
# least SLOW_RANK_FLOOR_S an epoch; the epoch that carries the start-up (workers, first reads) is left out.
INPUT_BOUND_SHARE = 0.5


def find_slow_rank(ranks: list, threshold: float = SLOW_RANK_THRESHOLD,
                   floor_s: float = SLOW_RANK_FLOOR_S) -> str | None:
    """The line naming the rank whose own time per step (all but sync) exceeds the other ranks' median (with two:
    the other's) by more than `threshold` and by `floor_s` over the epoch, and its costliest phase; else None."""
    if len(ranks) < 2 or not all(r["steps"] for r in ranks):
        return None
    own = [r["step_s"] - r["sync_s"] for r in ranks]
    slow = max(range(len(ranks)), key=own.__getitem__)
    others = [x for i, x in enumerate(ranks) if i != slow]
    median = statistics.median(own[:slow] + own[slow + 1:])
    if (median <= 0 or own[slow] <= median * (1 + threshold)
            or (own[slow] - median) * ranks[slow]["steps"] < floor_s):
        return None
    r = ranks[slow]
    excess = {p: r[f"{p}_s"] - statistics.median(x[f"{p}_s"] for x in others) for p in PHASES if p != "sync"}
    cause = max(excess, key=excess.get)
    return (f"rank {r['rank']} on {r['host']}: {own[slow] / median - 1:.0%} slower than the other ranks' "
            f"median, {r[f'{cause}_s'] / r['step_s']:.0%} of its step {PHASES[cause]}")


def find_input_bound(ranks: list, share: float = INPUT_BOUND_SHARE, floor_s: float = SLOW_RANK_FLOOR_S) -> str | None:
    """The line naming the rank that waited for data the largest share of its step, if more than `share` (and at
    least `floor_s` over the epoch), with the median rank's share; else None."""
    if not all(r["steps"] and r["step_s"] > 0 for r in ranks):
        return None
    worst = max(ranks, key=lambda r: r["data_s"] / r["step_s"])
    if worst["data_s"] / worst["step_s"] <= share or worst["data_s"] * worst["steps"] < floor_s:
        return None
    median = statistics.median(r["data_s"] / r["step_s"] for r in ranks)
    return (f"rank {worst['rank']} on {worst['host']} waited for data {worst['data_s'] / worst['step_s']:.0%} of "
            f"its step (the median rank: {median:.0%})")
