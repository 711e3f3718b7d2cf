"""Same math on any number of ranks: gradient accumulation as virtual ranks (--micro-batch), a resume
on fewer ranks with more accumulation steps, and the edge cases of --micro-batch and --sync-bn."""
import pytest

from conftest import TINY, assert_close_models, launch, load_model_state, read_jsonl
from train_utils import accumulation_steps

# 4 virtual ranks of 16: 5 steps of 64 and a short one of 45 (micro-batches of 12, 11, 11, 11) per
# epoch; BatchNorm in train mode, no dropout. Runs that differ only in float summation order (threads,
# all-reduce vs local accumulation) drift apart chaotically at a high LR: at this one, on the learnable
# synthetic data, they stay within 2e-6 of each other over 12 steps (0.2 gives 7e-4), where keeping
# every micro-step's BatchNorm statistics instead of micro-step 0's is 0.36 off (measured).
N_TRAIN = 365
RUN = ["--dataset", "synthetic", "--train-size", N_TRAIN, "--test-size", 50, "--batch-size", 64, "--epochs", 2,
       "--micro-batch", 16, "--base-lr", 0.1, "--warmup-epochs", 0.5, *TINY, "--device", "cpu"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("accum")
    procs = {}
    for ranks in (4, 2, 1):
        procs[ranks] = launch([*RUN, "--out-dir", base / f"w{ranks}"], nproc=ranks)
    return base, procs


def test_ranks_times_accumulation_steps_constant_gives_the_same_training(runs):
    base, procs = runs
    assert "Global batch 64 = 4 ranks x 16;" in procs[4].stdout
    assert "Global batch 64 = 2 ranks x 2 accumulation steps x 16;" in procs[2].stdout
    assert "Global batch 64 = 1 ranks x 4 accumulation steps x 16;" in procs[1].stdout
    ref = load_model_state(base / "w4")
    for ranks in (2, 1):
        got = load_model_state(base / f"w{ranks}")
        assert_close_models(ref, got)  # BN running statistics included: rank 0 keeps micro-step 0's
        m_ref, m_got = read_jsonl(base / "w4" / "metrics.jsonl"), read_jsonl(base / f"w{ranks}" / "metrics.jsonl")
        for a, b in zip(m_ref, m_got):
            assert a["train_samples"] == b["train_samples"] == N_TRAIN  # every sample once per epoch
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-4)


def test_a_run_resumed_on_fewer_ranks_keeps_the_micro_batch_and_the_trajectory(runs, tmp_path):
    base, _ = runs
    out = tmp_path / "run"
    launch([*RUN, "--out-dir", out, "--stop-after-epoch", 1], nproc=2)
    args = [a for a in RUN]
    i = args.index("--micro-batch")
    del args[i:i + 2]  # not given again: the checkpoint's micro-batch is kept
    second = launch([*args, "--out-dir", out], nproc=1)
    assert "Global batch 64 = 1 ranks x 4 accumulation steps x 16;" in second.stdout
    assert "note: 2 ranks x 2 accumulation steps x 16 before, 1 x 4 x 16 now: the same global batch" in second.stdout
    assert_close_models(load_model_state(base / "w2"), load_model_state(out))


@pytest.mark.parametrize("per_rank,micro,steps", [(32, 64, 1), (32, 32, 1), (32, 16, 2), (24, 10, 3), (24, 7, 4),
                                                  (30, 4, 10), (7, 3, 7), (32, None, 1)])
def test_accumulation_steps_split_the_rank_batch_equally(per_rank, micro, steps):
    assert accumulation_steps(per_rank, micro) == steps
    assert per_rank % steps == 0 and (micro is None or per_rank // steps <= micro)


@pytest.mark.parametrize("flags,says", [
    (["--micro-batch", 0], "--micro-batch is the most samples per forward on one rank, at least 1, got 0"),
    (["--micro-batch", -8], "--micro-batch is the most samples per forward on one rank, at least 1, got -8"),
    (["--sync-bn"], "--sync-bn needs CUDA GPUs"),
])
def test_bad_accumulation_flags(tmp_path, flags, says):
    proc = launch([*RUN, "--out-dir", tmp_path / "run", *flags], torchrun=False, check=False)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr


def test_a_last_step_that_leaves_a_rank_nothing_trains_the_same_as_accumulation(tmp_path):
    """129 samples in batches of 64: the last step holds one sample, so rank 1 of 2 gets an empty
    micro-batch; it still joins the gradient all-reduce, with zero, and the update is the mean
    over that one sample, as with 1 rank x 2 accumulation steps."""
    run = [*RUN, "--train-size", 129, "--micro-batch", 32, "--epochs", 1]
    launch([*run, "--out-dir", tmp_path / "two"], nproc=2)
    launch([*run, "--out-dir", tmp_path / "one"], nproc=1)
    assert_close_models(load_model_state(tmp_path / "two"), load_model_state(tmp_path / "one"))
    for ranks in ("one", "two"):
        assert read_jsonl(tmp_path / ranks / "metrics.jsonl")[0]["train_samples"] == 129
