"""Runs that cannot be fooled: evaluation with an empty shard, a checkpoint of other data, a resume
with another batch size, two runs on one out-dir, Ctrl-C, and --evaluate with nothing but --out-dir.
Each case first reproduced the wrong behaviour of an earlier version (a hang, a silent resume, a
wrong schedule, two writers, a traceback, a download attempt)."""
import json
import os
import signal
import socket
import time

import pytest

from conftest import TINY, kill_all, launch, load_model_state, read_json, read_jsonl, start, text, wait_for, write_cifar100
from train_utils import OutDirLock, UserError

TINY_SYNTH = ["--dataset", "synthetic", *TINY, "--device", "cpu"]


def test_empty_test_shard_neither_hangs_nor_miscounts_and_evaluate_needs_only_the_out_dir(tmp_path):
    out = tmp_path / "run"
    # 3 ranks, 2 test images: rank 2 scores nothing. A DDP forward in evaluation would wait for it forever.
    run = [*TINY_SYNTH, "--train-size", 60, "--test-size", 2, "--batch-size", 6, "--epochs", 1, "--timeout", 60]
    proc = launch([*run, "--out-dir", out], nproc=3, timeout=300)
    assert read_jsonl(out / "metrics.jsonl")[0]["val_count"] == 2
    # Nothing but --out-dir: the model (WRN-10-1, not the default 16-8) and the data (synthetic, not
    # CIFAR-100) come from the checkpoint; its batch 6 need not divide by the 4 ranks to evaluate.
    ev = launch(["--evaluate", "--out-dir", out, "--timeout", 60], nproc=4, timeout=300)
    lines = [ln for ln in ev.stdout.splitlines() if ln.strip()]
    assert lines[0].startswith(f"Evaluating {out}/checkpoint.pt (WRN-10-1 with 100 classes, 1 of 1 epochs trained)")
    assert lines[1].startswith("Validation Loss:") and lines[2].startswith("Validation Top-5 Accuracy:")
    assert len(lines) == 3, ev.stdout  # no training lines
    result = read_json(out / "eval.json")
    assert result["val_count"] == 2 and result["epoch"] == 1 and result["world_size"] == 4
    assert result["val_acc"] == read_jsonl(out / "metrics.jsonl")[0]["val_acc"]
    assert "Validation Accuracy: " in proc.stdout


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 1-epoch run on a generated CIFAR-format archive."""
    base = tmp_path_factory.mktemp("data")
    write_cifar100(str(base / "a"), 200, 40, archive=False)
    write_cifar100(str(base / "b"), 200, 40, archive=False, seed=1)  # the same sizes, other images
    out = base / "run"
    common = ["--data-dir", base / "a", "--out-dir", out, *TINY, "--device", "cpu", "--batch-size", 40]
    launch([*common, "--epochs", 1], torchrun=False)
    return base, out, common


@pytest.mark.parametrize("change,says", [
    (["--dataset", "synthetic"], "--dataset synthetic differs from the cifar100 of the checkpoint"),
    (["--train-size", 100], "--train-size 100 differs from the 0 of the checkpoint"),
    (["--test-size", 20], "--test-size 20 differs from the 0"),
    (["--seed", 1], "--seed 1 differs from the 0"),
    (["--depth", 16], "--depth 16 differs from the 10"),
    ("other data dir", "the train data in --data-dir"),
])
def test_a_run_on_other_data_is_refused_and_the_checkpoint_kept(finished, change, says):
    base, out, common = finished
    before = (out / "checkpoint.pt").read_bytes()
    args = [*common, "--epochs", 2]
    if change == "other data dir":
        args[args.index("--data-dir") + 1] = base / "b"
    else:
        args += change
    proc = launch(args, torchrun=False, check=False)
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
    proc = launch([*args, "--epochs", 2, "--base-lr", 0.02, "--workers", 1, "--log-every", 0], nproc=2)
    assert "note: resumed with changes: --batch-size 40 -> 20, --epochs 1 -> 2, --base-lr 0.01 -> 0.02" in proc.stdout
    assert "Resumed from" in proc.stdout and "Epoch 2/2" in proc.stdout and "Epoch 1/2" not in proc.stdout
    assert [m["epoch"] for m in read_jsonl(copy / "metrics.jsonl")] == [1, 2]


def test_resume_with_another_batch_size_keeps_its_place_in_samples(tmp_path):
    """Stopped mid-epoch at batch 64, resumed at 32: the epoch still trains each of its 1280 samples
    once, and the cosine schedule still ends at 0 at the end of the last epoch."""
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    run = [*TINY_SYNTH, "--train-size", 1280, "--test-size", 20, "--epochs", 2, "--workers", 0, "--out-dir", out]
    stop_file.touch()  # seen at the first check, after step 10 of 20
    first = launch([*run, "--batch-size", 64], nproc=2, env={"DDP_STOP_FILE": str(stop_file)}, check=False)
    assert first.returncode != 0 and "after step 10" in first.stdout
    assert load_model_state(out)["progress"]["position"] == 640
    stop_file.unlink()
    second = launch([*run, "--batch-size", 32], nproc=2)
    assert "note: the global batch changed from 64 to 32 on resume" in second.stdout
    assert "epoch 1 of 2 done" not in second.stdout and "0 of 2 done, and 640 samples (20 steps)" in second.stdout
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["train_samples"] for m in metrics] == [1280, 1280]
    peak = 0.01 * 32 / 512
    assert metrics[-1]["lr"] < 0.01 * peak  # the last step of the last epoch: cosine near its end
    assert metrics[0]["lr"] == pytest.approx(peak, rel=1e-6)  # epoch 1 ends the 1-epoch warm-up at the peak


def test_a_second_run_on_a_busy_out_dir_is_refused_and_a_killed_run_does_not_lock_the_next(tmp_path):
    out = tmp_path / "run"
    run = [*TINY_SYNTH, "--train-size", 4000, "--test-size", 20, "--batch-size", 16, "--epochs", 2,
           "--workers", 0, "--out-dir", out, "--log-every", 10]
    proc, log = start(run, nproc=2)
    wait_for(lambda: "step 10/" in text(log), what="the first run to train")
    owner = json.loads((out / "run.lock").read_text())
    second = launch([*run, "--epochs", 3], torchrun=False, check=False, timeout=120)
    assert second.returncode == 2
    assert f"is in use by another run (host {socket.gethostname()}, pid {owner['pid']}" in second.stderr
    assert "use another --out-dir" in second.stderr and "Resumed" not in second.stdout
    kill_all(proc)  # kill -9 of torchrun and both ranks: no cleanup runs
    assert (out / "run.lock").exists()
    third = launch(run, nproc=2)
    assert f"note: took over {out}/run.lock from host {socket.gethostname()}, pid {owner['pid']}" in third.stdout
    assert f"its process {owner['pid']} is gone" in third.stdout
    assert [m["epoch"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert not (out / "run.lock").exists()  # released at the end


def write_lock(out_dir, host, age_s, **fields):
    path = os.path.join(out_dir, OutDirLock.NAME)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": 4242, "started": 1, "slurm_job": None, "torchrun": None,
                   "token": "feedbeef", "since": "then", **fields}, f)
    t = time.time() - age_s
    os.utime(path, (t, t))


@pytest.mark.parametrize("age_s,fields,env,outcome", [
    (5, {}, {}, "refused"),  # alive on another node
    (OutDirLock.STALE_S + 30, {}, {}, "no heartbeat for"),  # that node died
    (5, {"slurm_job": "77"}, {"SLURM_JOB_ID": "77"}, "an earlier run of this Slurm job 77 (requeued)"),
    (5, {"slurm_job": "77"}, {"SLURM_JOB_ID": "78"}, "refused"),  # the same job submitted twice
    (5, {"torchrun": "rdzv-1"}, {"TORCHELASTIC_RUN_ID": "rdzv-1"}, "an earlier attempt of this torchrun job"),
])
def test_lock_held_on_another_node(tmp_path, monkeypatch, age_s, fields, env, outcome):
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    write_lock(tmp_path, "some-other-node", age_s, **fields)
    if outcome == "refused":
        with pytest.raises(UserError, match="is in use by another run .host some-other-node, pid 4242"):
            OutDirLock(str(tmp_path)).acquire()
        return
    lock = OutDirLock(str(tmp_path)).acquire()
    assert outcome in lock.note
    lock.check()
    write_lock(tmp_path, "a-third-node", 0)  # taken over by mistake: the owner notices before writing
    with pytest.raises(UserError, match="another run took over"):
        lock.check()
    lock.release()
    assert (tmp_path / OutDirLock.NAME).exists()  # not ours to remove


def test_ctrl_c_checkpoints_and_a_second_one_quits_at_once(tmp_path):
    run = [*TINY_SYNTH, "--train-size", 4000, "--test-size", 20, "--batch-size", 16, "--epochs", 1,
           "--workers", 1, "--log-every", 10]
    # A terminal's Ctrl-C: SIGINT to the whole foreground process group, loader workers included.
    proc, log = start([*run, "--out-dir", tmp_path / "once"], torchrun=False)
    wait_for(lambda: "step 10/" in text(log), what="training")
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 75
    out = text(log)
    assert "Stop requested (SIGINT) in epoch 1 after step" in out and "Traceback" not in out
    step = load_model_state(tmp_path / "once")["progress"]["step"]
    assert step % 10 == 0 and step >= 20
    resumed = launch([*run, "--out-dir", tmp_path / "once"], torchrun=False)
    assert f"({step} steps) of the next" in resumed.stdout and "Training completed successfully." in resumed.stdout

    slow = [a if a != 16 else 512 for a in run]  # steps of about a second, so the stop check is seconds away
    proc, log = start([*slow, "--out-dir", tmp_path / "twice"], torchrun=False)
    wait_for(lambda: "step 1/" in text(log), what="training")
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: "Ctrl-C: stopping" in text(log), what="the first Ctrl-C")
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    out = text(log)
    assert "Second Ctrl-C: quitting now" in out and "Traceback" not in out and "Stop requested" not in out
    assert not (tmp_path / "twice" / "checkpoint.pt").exists()


def test_ctrl_c_under_torchrun_checkpoints_on_every_rank(tmp_path):
    """torchrun's ranks run in sessions of their own: a Ctrl-C reaches torchrun, which forwards it."""
    out = tmp_path / "run"
    run = [*TINY_SYNTH, "--train-size", 4000, "--test-size", 20, "--batch-size", 16, "--epochs", 1,
           "--workers", 0, "--log-every", 10, "--out-dir", out]
    proc, log = start(run, nproc=2)
    wait_for(lambda: "step 10/" in text(log), what="training")
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert "Stop requested (SIGINT) in epoch 1 after step" in text(log)
    assert "train_ddp.py" not in "".join(ln for ln in text(log).splitlines() if ln.startswith("  File"))
    assert load_model_state(out)["progress"]["step"] > 0
