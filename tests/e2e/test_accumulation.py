"""Gradient accumulation as virtual ranks (--micro-batch): W ranks x A accumulation steps train as
W x A ranks do (4x1, 2x2, 1x4: the same parameters, BatchNorm statistics and losses, to float
summation order), a last step that leaves a rank nothing included. (A resume on fewer ranks with
more accumulation steps: test_resume.py; the split itself: tests/unit/test_sampler.py.)"""
import pytest

from support import (ACCUM_N_TRAIN, ACCUM_RUN, assert_close_models, launch_forked, load_model_state,
                     read_jsonl, run_in_process)


def test_ranks_times_accumulation_steps_constant_gives_the_same_training(accumulation_run):
    runs = {ranks: accumulation_run(ranks) for ranks in (4, 2, 1)}
    assert "Global batch 64 = 4 ranks x 16;" in runs[4][1]
    assert "Global batch 64 = 2 ranks x 2 accumulation steps x 16;" in runs[2][1]
    assert "Global batch 64 = 1 ranks x 4 accumulation steps x 16;" in runs[1][1]
    ref = load_model_state(runs[4][0])
    for ranks in (2, 1):
        got = load_model_state(runs[ranks][0])
        assert_close_models(ref, got)  # BN running statistics included: rank 0 keeps micro-step 0's
        m_ref, m_got = read_jsonl(runs[4][0] / "metrics.jsonl"), read_jsonl(runs[ranks][0] / "metrics.jsonl")
        assert len(m_ref) == len(m_got) == 2
        for a, b in zip(m_ref, m_got):
            assert a["train_samples"] == b["train_samples"] == ACCUM_N_TRAIN  # every sample once per epoch
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
            # summed over every rank's micro-batches: the same but for near-ties
            assert 0 < a["train_acc"] <= 1
            assert a["train_acc"] == pytest.approx(b["train_acc"], abs=2 / ACCUM_N_TRAIN)
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-4)


def test_a_last_step_that_leaves_a_rank_nothing_trains_the_same_as_accumulation(tmp_path):
    """129 samples in batches of 64: the last step holds one sample, so rank 1 of 2 gets an empty
    micro-batch; it still joins the gradient all-reduce, with zero, and the update is the mean
    over that one sample, as with 1 rank x 2 accumulation steps."""
    run = [*ACCUM_RUN, "--train-size", 129, "--micro-batch", 32, "--epochs", 1]
    launch_forked([*run, "--out-dir", tmp_path / "two"], nproc=2)
    run_in_process([*run, "--out-dir", tmp_path / "one"], check=True)
    assert_close_models(load_model_state(tmp_path / "two"), load_model_state(tmp_path / "one"))
    for ranks in ("one", "two"):
        assert read_jsonl(tmp_path / ranks / "metrics.jsonl")[0]["train_samples"] == 129
