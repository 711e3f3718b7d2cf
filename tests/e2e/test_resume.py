"""Resuming, all of it in one place: a resume is exact (at an epoch's end, and after a stop request
mid-epoch); it keeps the global batch and the LR schedule on another world size, its place in samples
with another batch size, the micro-batch and the trajectory on fewer ranks; it proceeds with a note
when only how the run goes changed (and with another precision); and a run on other data or another
model is refused, the checkpoint kept. (Resumes after faults: test_fault_tolerance.py; after Ctrl-C:
test_ctrl_c.py; under elastic torchrun: test_elastic.py; of older or foreign checkpoints:
test_bad_input.py.)"""
import os

import pytest
import torch

from support import (ACCUM_RUN, CKPT_RUN, TIMING_METRICS, TINY, assert_close_models, assert_same_weights,
                     launch_forked, load_model_state, launcher_and_ranks, paused, read_json, read_jsonl,
                     run_in_process, start, text, torchrun_root_cause, wait_for, write_cifar100)

TINY_SYNTH = ["--dataset", "synthetic", *TINY, "--device", "cpu"]
SMALL = ["--dataset", "synthetic", "--train-size", 64, "--test-size", 20, "--batch-size", 32,
         "--epochs", 1, *TINY]


# --------------------------------------------------------------------------- exact resumes

@pytest.mark.quick
def test_resume_is_exact(tmp_path, uninterrupted_run):
    """CKPT_RUN stopped after epoch 1 and resumed, with a loader worker (the uninterrupted run has none: the
    workers change nothing), ends with the uninterrupted run's weights, optimizer state and metrics."""
    run = [*CKPT_RUN, "--workers", 1, "--out-dir", tmp_path / "resumed"]
    resumed = tmp_path / "resumed"
    first = launch_forked([*run, "--stop-after-epoch", 1], nproc=2)
    assert "Stopping after epoch 1" in first.stdout
    assert read_json(resumed / "summary.json")["finished"] is False
    second = launch_forked(run, nproc=2)
    assert ("Resumed from" in second.stdout and "Epoch 1/2" not in second.stdout
            and "Epoch 2/2" in second.stdout)

    a, b = load_model_state(uninterrupted_run), load_model_state(resumed)
    assert a["progress"]["epoch"] == b["progress"]["epoch"] == 2
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert a["progress"]["position"] == b["progress"]["position"] == 0
    ma, mb = read_jsonl(uninterrupted_run / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [m["epoch"] for m in mb] == [1, 2]
    timing = set(TIMING_METRICS)
    for x, y in zip(ma, mb):
        assert ({k: v for k, v in x.items() if k not in timing}
                == {k: v for k, v in y.items() if k not in timing})
    summary = read_json(resumed / "summary.json")
    assert summary["finished"] is True and summary["epochs_completed"] == 2


def test_stop_request_mid_epoch_checkpoints_and_resumes_exactly(tmp_path, uninterrupted):
    """A stop request (the job scripts' stop file) in the middle of epoch 2: every rank stops at the next
    check with a mid-epoch checkpoint, and the same command resumes there and ends with the weights of
    the uninterrupted run, bit for bit."""
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    proc, log = start([*CKPT_RUN, "--out-dir", out], env={"DDP_STOP_FILE": str(stop_file)})
    wait_for(lambda: "Epoch 1/2 completed" in text(log) or proc.poll() is not None, what="epoch 1's end")
    with paused(launcher_and_ranks(proc)):  # lands in epoch 2 however fast the machine is
        stop_file.touch()  # what the job scripts do when Slurm signals them; seen at the next check
    assert proc.wait(timeout=120) != 0  # the ranks exit 75; torchrun reports the failure
    output = text(log)
    assert "Stop requested (stop file" in output and "in epoch 2 after step" in output
    assert "exiting with status 75" in output
    # torchrun's failure report says why its ranks exited 75
    assert torchrun_root_cause(output).startswith("Stop requested (stop file"), output
    progress = load_model_state(out)["progress"]
    assert progress["epoch"] == 1 and 0 < progress["position"] < 640, progress  # mid-epoch 2, not at an end
    stop_file.unlink()
    second = launch_forked([*CKPT_RUN, "--out-dir", out], nproc=2, env={"DDP_STOP_FILE": str(stop_file)})
    assert (f"Resumed from {out}/checkpoint.pt: epoch 1 of 2 done, and {progress['position']} samples "
            f"({progress['step']} steps) of the next.") in second.stdout
    assert_same_weights(out, uninterrupted)
    assert [m["epoch"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_resume_on_another_world_size_keeps_batch_and_schedule(tmp_path):
    """Stopped in the middle of epoch 2 on 2 ranks, resumed on 3: the same global batch (48), the LR of
    every epoch that of an uninterrupted run at that global batch (one process: the LR is the global batch's
    and the step's), every epoch's samples each trained once, and the run finishes. (The weights differ
    from an uninterrupted 2-rank run's by float summation order only.)"""
    # 48 divides by 2 and by 3: 14 steps per epoch, the last of 16
    run = [a if a != 32 else 48 for a in CKPT_RUN]
    reference, out, stop_file = tmp_path / "reference", tmp_path / "run", tmp_path / "stop"
    run_in_process([*run, "--out-dir", reference], check=True)
    proc, log = start([*run, "--out-dir", out], nproc=2, env={"DDP_STOP_FILE": str(stop_file)})
    wait_for(lambda: "Epoch 1/2 completed" in text(log) or proc.poll() is not None, what="epoch 1's end")
    with paused(launcher_and_ranks(proc)):  # lands in epoch 2 however fast the machine is
        stop_file.touch()
    assert proc.wait(timeout=120) != 0
    assert "Global batch 48 = 2 ranks x 24" in text(log) and "Stop requested (stop file" in text(log)
    before = load_model_state(out)
    position = before["progress"]["position"]
    assert before["progress"]["epoch"] == 1 and 0 < position < 640, before["progress"]  # mid-epoch 2
    assert before["world_size"] == 2
    stop_file.unlink()
    second = launch_forked([*run, "--out-dir", out], nproc=3)
    assert "Global batch 48 = 3 ranks x 16" in second.stdout  # the same global batch, on 3 ranks
    assert ("note: 2 ranks x 1 accumulation steps x 24 before, 3 x 1 x 16 now: the same global batch"
            in second.stdout)
    assert f"epoch 1 of 2 done, and {position} samples" in second.stdout  # the epoch goes on where it stopped
    after = load_model_state(out)
    assert (after["config"]["batch_size"] == 48 and after["config"]["world_size"] == 3
            and after["world_size"] == 3)
    assert after["config"]["lr"] == before["config"]["lr"]  # the same peak LR
    got, want = read_jsonl(out / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert [m["epoch"] for m in got] == [m["epoch"] for m in want] == [1, 2]
    assert all(m["train_samples"] == 640 for m in got)  # each epoch's samples once, the resumed one's too
    for g, w in zip(got, want):  # the LR of each epoch's last step: the schedule's place kept
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-9, abs=1e-12), (g["epoch"], g["lr"], w["lr"])
    assert 0 < got[-1]["lr"] < got[0]["lr"]  # not a constant: the cosine's value near its end
    summary = read_json(out / "summary.json")
    assert summary["finished"] is True and summary["world_size"] == 3 and summary["epochs_completed"] == 2


# --------------------------------------------------------------------------- resumes that change the run

def test_resume_with_another_batch_size_keeps_its_place_in_samples(tmp_path):
    """Stopped mid-epoch at batch 64, resumed at 32: the epoch still trains each of its 1280 samples
    once, and the cosine schedule still ends at 0 at the end of the last epoch. (One process: the samples and
    the schedule are the global batch's; another world size: test_resume_on_another_world_size_...)"""
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    run = [*TINY_SYNTH, "--train-size", 1280, "--test-size", 20, "--epochs", 2, "--workers", 0,
           "--out-dir", out]
    stop_file.touch()  # seen at the first check, after step 10 of 20
    first = run_in_process([*run, "--batch-size", 64], env={"DDP_STOP_FILE": str(stop_file)})
    assert first.returncode == 75 and "after step 10" in first.stdout
    assert load_model_state(out)["progress"]["position"] == 640
    stop_file.unlink()
    second = run_in_process([*run, "--batch-size", 32], check=True)
    assert "note: the global batch changed from 64 to 32 on resume" in second.stdout
    assert ("epoch 1 of 2 done" not in second.stdout
            and "0 of 2 done, and 640 samples (20 steps)" in second.stdout)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["train_samples"] for m in metrics] == [1280, 1280]
    peak = 0.01 * 32 / 512
    assert metrics[-1]["lr"] < 0.01 * peak  # the last step of the last epoch: cosine near its end
    assert metrics[0]["lr"] == pytest.approx(peak, rel=1e-6)  # epoch 1 ends the 1-epoch warm-up at the peak


def test_a_run_resumed_on_fewer_ranks_keeps_the_micro_batch_and_the_trajectory(accumulation_run, tmp_path):
    """2 ranks x 16 stopped after epoch 1, resumed on 1 rank without --micro-batch: the checkpoint's
    micro-batch is kept (2 accumulation steps of 16), and the run ends where the 2-rank run ends."""
    out = tmp_path / "run"
    launch_forked([*ACCUM_RUN, "--out-dir", out, "--stop-after-epoch", 1], nproc=2)
    args = [a for a in ACCUM_RUN]
    i = args.index("--micro-batch")
    del args[i:i + 2]  # not given again: the checkpoint's micro-batch is kept
    second = run_in_process([*args, "--out-dir", out], check=True)  # 1 rank
    assert "Global batch 64 = 1 ranks x 4 accumulation steps x 16;" in second.stdout
    assert ("note: 2 ranks x 2 accumulation steps x 16 before, 1 x 4 x 16 now: the same global batch"
            in second.stdout)
    assert_close_models(load_model_state(accumulation_run(2)[0]), load_model_state(out))


@pytest.mark.parametrize("first, then", [("off", "fp16"), ("fp16", "off")])
def test_resume_with_another_precision(tmp_path, first, then):
    """An fp16 run's grad-scaler state is absent from other runs' checkpoints, and unused by them."""
    out = tmp_path / "run"
    run_in_process([*SMALL, "--epochs", 2, "--stop-after-epoch", 1, "--amp", first, "--out-dir", out],
                   check=True)
    assert bool(load_model_state(out)["scaler"]) == (first == "fp16")  # the scaler's state: fp16's alone
    proc = run_in_process([*SMALL, "--epochs", 2, "--amp", then, "--out-dir", out], check=True)
    assert "Resumed from" in proc.stdout and "Training completed successfully." in proc.stdout
    ckpt = load_model_state(out)
    assert ckpt["config"]["amp"] == then and bool(ckpt["scaler"]) == (then == "fp16")
    assert [m["epoch"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]


# ---------------------------------------------------------------------- what a resume may change, and may not

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 1-epoch run on a generated CIFAR-format archive."""
    base = tmp_path_factory.mktemp("data")
    write_cifar100(str(base / "a"), 200, 40, archive=False)
    write_cifar100(str(base / "b"), 200, 40, archive=False, seed=1)  # the same sizes, other images
    out = base / "run"
    common = ["--data-dir", base / "a", "--out-dir", out, *TINY, "--device", "cpu", "--batch-size", 40]
    run_in_process([*common, "--epochs", 1], check=True)
    return base, out, common


@pytest.mark.parametrize("change,says", [
    (["--dataset", "synthetic"], "--dataset synthetic differs from the cifar100 of the checkpoint"),
    (["--train-size", 100], "--train-size 100 differs from the 0 of the checkpoint"),
    (["--test-size", 20], "--test-size 20 differs from the 0"),
    (["--seed", 1], "--seed 1 differs from the 0"),
    (["--depth", 16], "--depth 16 differs from the 10"),
    ("other data dir", "the train data in --data-dir"),
])
def test_a_run_on_other_data_or_another_model_is_refused_and_the_checkpoint_kept(finished, change, says):
    base, out, common = finished
    before = (out / "checkpoint.pt").read_bytes()
    args = [*common, "--epochs", 2]
    if change == "other data dir":
        args[args.index("--data-dir") + 1] = base / "b"
    else:
        args += change
    proc = run_in_process(args)  # refused before training: no fresh interpreter needed
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "another --out-dir" in err[0], proc.stderr
    assert "Resumed" not in proc.stdout and "Training completed" not in proc.stdout
    assert (out / "checkpoint.pt").read_bytes() == before


def test_a_run_that_changes_only_what_may_change_resumes(finished, tmp_path):
    base, out, common = finished
    copy = tmp_path / "run"
    os.makedirs(copy)
    for name in os.listdir(out):
        (copy / name).write_bytes((out / name).read_bytes())
    args = [a if a != out else copy for a in common]
    args[args.index("--batch-size") + 1] = 20
    proc = launch_forked([*args, "--epochs", 2, "--base-lr", 0.02, "--workers", 1, "--log-every", 0], nproc=2)
    assert ("note: resumed with changes: --batch-size 40 -> 20, --epochs 1 -> 2, --base-lr 0.01 -> 0.02"
            in proc.stdout)
    assert "Resumed from" in proc.stdout and "Epoch 2/2" in proc.stdout and "Epoch 1/2" not in proc.stdout
    assert [m["epoch"] for m in read_jsonl(copy / "metrics.jsonl")] == [1, 2]


def test_deterministic_sets_the_kernels_records_them_and_a_resume_that_changes_it_is_noted(tmp_path):
    """--deterministic: cuDNN's and cuBLAS's deterministic algorithms, cudnn.benchmark off, CUBLAS_WORKSPACE_CONFIG
    set before cuBLAS makes its first handle (an op without a deterministic algorithm warns); config.json and
    run.json say so. A resume without it goes on with the default kernels, and its log says what changed."""
    out = tmp_path / "run"
    run = ["--dataset", "synthetic", "--train-size", 128, "--test-size", 64, "--batch-size", 32, "--epochs", 2, *TINY,
           "--log-every", 0, "--out-dir", out]
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    try:
        run_in_process([*run, "--deterministic", "--stop-after-epoch", 1], check=True)
        assert read_json(out / "config.json")["deterministic"] is True
        assert read_json(out / "run.json")["kernels"] == {
            "deterministic_algorithms": True, "cudnn_deterministic": True, "cudnn_benchmark": False,
            "cublas_workspace_config": ":4096:8"}
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        resumed = run_in_process(run, check=True)
        assert "note: resumed with changes: --deterministic True -> False" in resumed.stdout
        assert "Training completed successfully." in resumed.stdout
        kernels = read_json(out / "run.json")["kernels"]
        assert kernels["deterministic_algorithms"] is False and kernels["cudnn_benchmark"] is True
    finally:  # this process runs other tests next
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2:]
