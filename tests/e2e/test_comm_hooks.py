"""DDP's communication hooks (--comm-hook: train_ddp.wrap_ddp registers torch's own): on 2 gloo ranks each hook
trains and resumes, fp16's and bf16's at the same world size bit for bit; fp16's all-reduced gradient is the mean of
the ranks' fp16-rounded gradients; PowerSGD restarts its compression on a resume and says so, as the resume says that
the hook changed. (A hook the backend cannot run, and the flags' checks: tests/unit/test_comm_hook_flags.py.)"""
import json
import math
import os

import torch

from support import CKPT_RUN, ROOT, assert_same_weights, launch_forked, load_model_state


def differs(a, b) -> bool:
    return any(not torch.equal(v, b["model"][k]) for k, v in a["model"].items() if v.is_floating_point())


def test_fp16_trains_on_2_ranks_and_resumes_bit_for_bit_at_the_same_world_size(tmp_path, uninterrupted):
    """CKPT_RUN with --comm-hook fp16, whole and stopped after epoch 1 then resumed: the same weights bit for bit,
    which differ from the same run's without the hook (conftest's `uninterrupted`): the hook rounded them."""
    run = [*CKPT_RUN, "--comm-hook", "fp16"]
    whole = launch_forked([*run, "--out-dir", tmp_path / "whole"])
    assert ("note: --comm-hook fp16 rounds the all-reduced gradients to 16 bits: the run no longer trains bit for "
            "bit as one with another split of the same global batch") in whole.stdout
    launch_forked([*run, "--out-dir", tmp_path / "resumed", "--stop-after-epoch", 1])
    resumed = launch_forked([*run, "--out-dir", tmp_path / "resumed"])
    assert "Resumed from" in resumed.stdout and "resumed with changes" not in resumed.stdout
    assert_same_weights(tmp_path / "resumed", load_model_state(tmp_path / "whole"))
    assert differs(load_model_state(tmp_path / "whole"), uninterrupted)


def test_bf16_trains_on_2_ranks_and_resumes(tmp_path, uninterrupted):
    """CKPT_RUN with --comm-hook bf16, stopped after epoch 1 and resumed: it finishes, its loss finite, its weights
    not those of the run without the hook."""
    run = [*CKPT_RUN, "--comm-hook", "bf16", "--out-dir", tmp_path / "run"]
    launch_forked([*run, "--stop-after-epoch", 1])
    resumed = launch_forked(run)
    assert "Resumed from" in resumed.stdout and "Training completed successfully." in resumed.stdout
    state = load_model_state(tmp_path / "run")
    assert state["progress"]["epoch"] == 2
    assert all(math.isfinite(m["train_loss"]) for m in state["progress"]["history"])
    assert differs(state, uninterrupted)


def test_powersgd_resumed_from_another_hook_is_noted_and_restarts_its_compression(tmp_path, uninterrupted):
    """CKPT_RUN stopped after epoch 1 with --comm-hook fp16, resumed with --comm-hook powersgd (3 plain steps, then
    compressed): the resume says the hook changed and that PowerSGD starts afresh, and the run finishes, trained
    otherwise than without a hook."""
    out = tmp_path / "run"
    launch_forked([*CKPT_RUN, "--comm-hook", "fp16", "--out-dir", out, "--stop-after-epoch", 1])
    resumed = launch_forked([*CKPT_RUN, "--comm-hook", "powersgd", "--powersgd-start", 3, "--out-dir", out])
    assert "note: resumed with changes: --comm-hook fp16 -> powersgd" in resumed.stdout, resumed.stdout
    assert ("note: PowerSGD starts afresh on this resume: 3 steps of plain all-reduce, then compression with no "
            "error carried over") in resumed.stdout
    assert "Training completed successfully." in resumed.stdout
    assert differs(load_model_state(out), uninterrupted)


def test_the_fp16_hooks_all_reduced_gradient_is_the_mean_of_the_ranks_fp16_rounded_gradients():
    """fp16_compress_hook through wrap_ddp on 2 ranks: each rank's gradients rounded to fp16 and halved, summed in
    fp16 (one rounding: two ranks' sum has no order), back to fp32; not the fp32 mean (the rounding is there)."""
    proc = launch_forked([ROOT], nproc=2, script=os.path.join("tests", "scripts", "comm_hook_grads.py"))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["equals_rounded_mean"], result
    assert not result["equals_fp32_mean"] and 0 < result["largest_difference_from_fp32"] < 1e-2, result
