"""Fault injection: a killed rank, a stop request, corrupt checkpoints, another world size, a hung
peer, a non-finite loss and a malicious checkpoint. Each loses at most the work since the last
checkpoint, and the resumed runs end with exactly the weights of an uninterrupted run."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TINY, launch, load_model_state, read_json, read_jsonl, start, text, wait_for
from dataset_utils import EpochSampler, micro_batch_sizes
from train_utils import StopRequest, UserError, load_latest_checkpoint, save_checkpoint

# 640 samples / 32 = 20 steps per epoch; dropout and a worker so RNG and loader state matter.
RUN = ["--dataset", "synthetic", "--train-size", 640, "--test-size", 64, "--batch-size", 32, "--epochs", 2,
       "--dropout", 0.1, *TINY, "--workers", 1, "--checkpoint-every", 4]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every faulty run must match."""
    out = tmp_path_factory.mktemp("reference") / "run"
    launch([*RUN, "--out-dir", out], nproc=2)
    return load_model_state(out)


def assert_same_weights(out_dir, reference):
    got = load_model_state(out_dir)
    assert got["progress"]["epoch"] == reference["progress"]["epoch"]
    for k, v in reference["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["progress"]["position"] == reference["progress"]["position"]


def workers_of(proc):
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in out)


def test_killed_rank_restarts_and_ends_with_identical_weights(tmp_path, reference):
    out = tmp_path / "run"
    proc, log = start([*RUN, "--out-dir", out], extra=["--max-restarts=3"])
    wait_for(lambda: (out / "checkpoint.pt").exists(), what="the first checkpoint")
    killed_at = time.time()
    os.kill(workers_of(proc)[-1], signal.SIGKILL)  # kill -9 one rank mid-epoch
    assert proc.wait(timeout=300) == 0, text(log)
    output = text(log)
    assert "Resumed from" in output, "the restarted ranks must resume from the checkpoint"
    assert "Training completed successfully." in output
    assert_same_weights(out, reference)
    assert time.time() - killed_at < 120


def test_stop_request_mid_epoch_checkpoints_and_resumes_exactly(tmp_path, reference):
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    proc, log = start([*RUN, "--out-dir", out], env={"DDP_STOP_FILE": str(stop_file)})
    wait_for(lambda: "Global batch" in text(log), what="training to start")
    time.sleep(1.0)
    stop_file.touch()  # what the job scripts do when Slurm signals them
    assert proc.wait(timeout=120) != 0  # the ranks exit 75; torchrun reports the failure
    output = text(log)
    assert "Stop requested (stop file" in output and "exiting with status 75" in output
    ckpt = load_model_state(out)
    stopped_at = (ckpt["progress"]["epoch"], ckpt["progress"]["step"])
    assert stopped_at < (2, 0), "stopped before the end"
    stop_file.unlink()
    second = launch([*RUN, "--out-dir", out], nproc=2, env={"DDP_STOP_FILE": str(stop_file)})
    assert "Resumed from" in second.stdout
    assert_same_weights(out, reference)
    assert [m["epoch"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, reference):
    out = tmp_path / "run"
    launch([*RUN, "--out-dir", out, "--stop-after-epoch", 1], nproc=2)
    latest, previous = out / "checkpoint.pt", out / "checkpoint.1.pt"
    assert load_model_state(out)["progress"]["epoch"] == 1
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])  # truncated, as by a full disk
    (out / ".checkpoint.pt.x1y2.tmp").write_bytes(data[:1000])  # a write killed halfway
    second = launch([*RUN, "--out-dir", out], nproc=2)
    assert "cannot be loaded" in second.stderr and f"using the older {previous}" in second.stderr
    assert "Resumed from" in second.stdout and "steps) of the next" in second.stdout  # the mid-epoch one
    assert_same_weights(out, reference)
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert kept == ["checkpoint.1.pt", "checkpoint.pt"]  # --keep-checkpoints 2


@pytest.mark.parametrize("moment, survivor", [("mid-write", "checkpoint.pt"), ("before-rename", "checkpoint.1.pt")])
def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path, moment, survivor):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "helpers", "kill_during_save.py"),
                           str(tmp_path), moment], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the killed write left its partial file"
    ckpt, path = load_latest_checkpoint(str(tmp_path), torch.device("cpu"), keep=2)
    assert path == str(tmp_path / survivor) and ckpt["progress"]["epoch"] == 2  # the last complete one
    assert torch.equal(ckpt["model"]["w"], torch.full((1 << 20,), 2.0))
    save_checkpoint(str(tmp_path), {"model": {}, "progress": {"epoch": 3}}, keep=2)  # the next save tidies up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.1.pt", "checkpoint.pt"]


def test_resume_on_another_world_size_keeps_batch_and_schedule(tmp_path):
    run = [a if a != 32 else 48 for a in RUN]  # 48 divides by 2 and by 3
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    proc, log = start([*run, "--out-dir", out], nproc=2, env={"DDP_STOP_FILE": str(stop_file)})
    wait_for(lambda: "Global batch" in text(log), what="training to start")
    time.sleep(1.0)
    stop_file.touch()
    proc.wait(timeout=120)
    before = load_model_state(out)["progress"]
    assert (before["epoch"], before["step"]) < (2, 0)
    stop_file.unlink()
    second = launch([*run, "--out-dir", out], nproc=3)
    assert "Global batch 48 = 3 ranks x 16" in second.stdout
    ckpt = load_model_state(out)
    assert ckpt["progress"]["epoch"] == 2 and len(read_jsonl(out / "metrics.jsonl")) == 2
    assert read_json(out / "summary.json")["finished"] is True


@pytest.mark.quick
@pytest.mark.parametrize("first,second", [((2, 1, 48), (3, 1, 48)), ((3, 1, 48), (2, 1, 48)), ((4, 1, 48), (1, 1, 48)),
                                          ((2, 1, 64), (2, 1, 32)), ((2, 2, 64), (1, 1, 24)), ((1, 4, 32), (3, 2, 96)),
                                          ((2, 1, 2), (3, 1, 3))])
def test_sampler_resumed_on_another_world_size_or_batch_sees_the_rest_of_the_epoch(first, second):
    """(world size, accumulation steps, global batch) before and after a mid-epoch resume."""
    n, done_steps = 601, 5
    seen, position = [], done_steps * first[2]
    for (ws, accum, batch), begin in ((first, 0), (second, position)):
        shards = []
        for rank in range(ws):
            s = EpochSampler(n, batch, rank, ws, accum, seed=3)
            s.set_epoch(7, start=begin)
            steps = list(s)
            assert len(steps) == len(s)
            shards.append(steps[:done_steps] if begin == 0 else steps)
            seen += [i for keys in shards[-1] for e, i in keys if e == 7]
        assert len({len(sh) for sh in shards}) == 1, "every rank takes the same number of steps"
        for k in range(len(shards[0])):  # the micro-batches train_step will split, the short last step's too
            step_samples = min(batch, n - begin - k * batch)
            assert [len(sh[k]) for sh in shards] == [sum(micro_batch_sizes(step_samples, r, ws, accum))
                                                     for r in range(ws)]
    # The first run's steps, then the rest of the epoch: every sample exactly once, nothing padded.
    assert sorted(seen) == list(range(n))


def test_hung_peer_times_out_with_a_clear_message_and_sigusr2_dumps_stacks(tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--out-dir", out, "--timeout", 8, "--epochs", 20]
    proc, log = start(args)
    wait_for(lambda: (out / "checkpoint.pt").exists(), what="training to start")
    hung = workers_of(proc)[-1]
    os.kill(hung, signal.SIGUSR2)
    # The dump shows where the rank is, down to the recipe's frames (wait for all of it).
    wait_for(lambda: "train_ddp.py\", line" in text(log), timeout=30, what="the stack dump")
    os.kill(hung, signal.SIGSTOP)  # a hung peer: alive, but never answers
    stopped_at = time.time()
    try:
        wait_for(lambda: "timed out" in text(log), timeout=60, what="the timeout message")
        waited = time.time() - stopped_at
    finally:
        os.kill(hung, signal.SIGKILL)
        proc.wait(timeout=60)
    output = text(log)
    assert "most recent call first" in output
    assert "error: rank 0: a collective operation timed out after 8 s: another rank is hung or dead" in output
    assert waited < 30, f"took {waited:.0f} s, not about --timeout"


def test_rendezvous_timeout_names_what_timed_out(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # rank 1 never comes
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_ddp.py"), "--dataset", "synthetic",
                           "--timeout", "4", "--out-dir", str(tmp_path / "run")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and time.time() - t0 < 60
    assert f"timed out after 4 s in init_process_group waiting for all 2 ranks at 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_nonfinite_loss_stops_with_a_clear_error_and_saves_nothing(tmp_path):
    out = tmp_path / "run"
    base = ["--dataset", "synthetic", "--train-size", 512, "--test-size", 32, "--batch-size", 32, "--epochs", 2,
            "--out-dir", out, *TINY]
    launch([*base, "--stop-after-epoch", 1], torchrun=False)
    good = (out / "checkpoint.pt").read_bytes()
    proc = launch([*base, "--base-lr", 1e30], torchrun=False, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: the training loss became NaN or infinite" in proc.stderr
    assert (out / "checkpoint.pt").read_bytes() == good


def test_fp16_divergence_stops_with_a_clear_error(tmp_path):
    out = tmp_path / "run"
    base = ["--dataset", "synthetic", "--train-size", 512, "--test-size", 32, "--batch-size", 32, "--epochs", 2,
            "--out-dir", out, "--amp", "fp16", *TINY]
    launch([*base, "--stop-after-epoch", 1], torchrun=False)
    good = (out / "checkpoint.pt").read_bytes()
    proc = launch([*base, "--base-lr", 1e30], torchrun=False, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: the training loss was NaN or infinite in most fp16 steps since the last check" in proc.stderr
    assert "--amp bf16" in proc.stderr
    assert (out / "checkpoint.pt").read_bytes() == good


def test_nonfinite_loss_policy():
    """Without a grad scaler any non-finite loss stops the run; with fp16's scaler, which skips
    those steps, only a majority of them since the previous check (divergence) does."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    cpu = torch.device("cpu")

    def sums(bad_steps, steps):  # loss * n, finite n, n for `steps` steps of 32 samples
        return torch.tensor([1.0, (steps - bad_steps) * 32, steps * 32], dtype=torch.float64)
    try:
        assert StopRequest().check(cpu, sums(0, 10), False) is False
        with pytest.raises(UserError, match="became NaN or infinite"):
            StopRequest().check(cpu, sums(1, 10), False)
        fp16 = StopRequest()
        assert fp16.check(cpu, sums(4, 10), True) is False  # overflows the scaler skips
        assert fp16.check(cpu, sums(8, 20), True) is False  # 4 of the last 10
        with pytest.raises(UserError, match="most fp16 steps since the last check"):
            fp16.check(cpu, sums(14, 30), True)  # 6 of the last 10, though 14 of all 30
        fp16 = StopRequest()
        fp16.check(cpu, sums(0, 90), True)
        with pytest.raises(UserError, match="most fp16 steps"):
            fp16.check(cpu, sums(10, 100), True)  # diverged: caught within 10 steps, not after half an epoch
        assert fp16.check(cpu, sums(2, 10), True) is False  # a new epoch restarts the sums
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_checkpoint_holding_pickled_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))
    torch.save({"model": {}, "progress": Payload()}, tmp_path / "checkpoint.pt")
    with pytest.raises(UserError, match="no usable checkpoint.*cannot be loaded"):
        load_latest_checkpoint(str(tmp_path), torch.device("cpu"), keep=2)
    assert not (tmp_path / "owned").exists()
