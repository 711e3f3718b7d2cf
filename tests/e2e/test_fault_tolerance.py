"""Faults, injected for real: a rank killed with kill -9 (torchrun restarts the ranks, which resume and
end with the weights of an uninterrupted run, bit for bit), a truncated latest checkpoint (the
previous one is used, to the same end), a hung peer (a clear timeout in about --timeout; SIGUSR2
dumps the stacks), a rank that never joins, and a non-finite loss (fp32 and fp16 divergence: a clear
error, the good checkpoint untouched), a bug mid-training (its traceback, and its frames freed before the
interpreter's finalization), and a rank killed with kill -9 leaves no process of its run behind (its loader
workers and their forkserver included). (Stop requests and resumes: test_resume.py; a kill during a
checkpoint's write: tests/unit/test_checkpoint_files.py.)"""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import support
from support import (CKPT_RUN, ROOT, TINY, assert_same_weights, descendants, every_process, launch,
                     launch_forked, launcher_and_ranks, load_model_state, run_in_process, start, text, wait_for)


def workers_of(proc):
    return sorted(launcher_and_ranks(proc)[1:])


def test_killed_rank_restarts_and_ends_with_identical_weights(tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc, log = start([*CKPT_RUN, "--out-dir", out], extra=["--max-restarts=3"])
    wait_for(lambda: (out / "checkpoint.pt").exists(), what="the first checkpoint")
    killed_at = time.time()
    os.kill(workers_of(proc)[-1], signal.SIGKILL)  # kill -9 one rank mid-epoch
    assert proc.wait(timeout=300) == 0, text(log)
    output = text(log)
    assert "Resumed from" in output, "the restarted ranks must resume from the checkpoint"
    assert "Training completed successfully." in output
    assert_same_weights(out, uninterrupted)
    assert time.time() - killed_at < 120


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, uninterrupted):
    out = tmp_path / "run"
    launch_forked([*CKPT_RUN, "--out-dir", out, "--stop-after-epoch", 1], nproc=2)
    latest, previous = out / "checkpoint.pt", out / "checkpoint.1.pt"
    assert load_model_state(out)["progress"]["epoch"] == 1
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])  # truncated, as by a full disk
    (out / ".checkpoint.pt.x1y2.tmp").write_bytes(data[:1000])  # a write killed halfway
    second = launch_forked([*CKPT_RUN, "--out-dir", out], nproc=2)
    assert "cannot be loaded" in second.stderr and f"using the older {previous}" in second.stderr
    assert "Resumed from" in second.stdout and "steps) of the next" in second.stdout  # the mid-epoch one
    assert_same_weights(out, uninterrupted)
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert kept == ["checkpoint.1.pt", "checkpoint.pt"]  # --keep-checkpoints 2


def rank_of(pid) -> int:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return int(dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)[b"RANK"])


def test_hung_peer_times_out_naming_the_rank_that_never_arrived_and_sigusr2_dumps_stacks(tmp_path):
    out = tmp_path / "run"
    args = [*CKPT_RUN, "--out-dir", out, "--timeout", 8, "--epochs", 20]
    proc, log = start(args)
    wait_for(lambda: (out / "checkpoint.pt").exists(), what="training to start")
    hung = next(pid for pid in workers_of(proc) if rank_of(pid) == 1)
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
    # Rank 0 names rank 1 and its host (the store knows who never arrived), and says nothing vaguer.
    assert (f"error: rank 0: a collective operation timed out after 8 s: rank 1 on {socket.gethostname()} "
            f"never reached it (hung" in output)
    assert "another rank is hung or dead" not in output
    assert waited < 30, f"took {waited:.0f} s, not about --timeout"


def test_rendezvous_timeout_names_what_timed_out(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # rank 1 never comes
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_ddp.py"), "--dataset", "synthetic",
                           "--timeout", "4", "--out-dir", str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and time.time() - t0 < 60
    assert (f"timed out after 4 s in init_process_group waiting for all 2 ranks at 127.0.0.1:{port}"
            in proc.stderr)
    assert "Traceback" not in proc.stderr


def test_nonfinite_loss_stops_with_a_clear_error_and_saves_nothing(tmp_path):
    out = tmp_path / "run"
    base = ["--dataset", "synthetic", "--train-size", 512, "--test-size", 32, "--batch-size", 32,
            "--epochs", 2, "--out-dir", out, *TINY]
    run_in_process([*base, "--stop-after-epoch", 1], check=True)
    good = (out / "checkpoint.pt").read_bytes()
    proc = launch([*base, "--base-lr", 1e30], torchrun=False, check=False)  # a process: its exit is the point
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: the training loss became NaN or infinite" in proc.stderr
    assert (out / "checkpoint.pt").read_bytes() == good


def test_fp16_divergence_stops_with_a_clear_error(tmp_path):
    """fp16 on a CPU is slow (no native kernels): 4 steps of 16 an epoch, the first finite, then NaN from the huge
    LR's weights: most steps since the last check (the epoch's end) not finite."""
    out = tmp_path / "run"
    base = ["--dataset", "synthetic", "--train-size", 64, "--test-size", 16, "--batch-size", 16,
            "--epochs", 2, "--out-dir", out, "--amp", "fp16", *TINY]
    run_in_process([*base, "--stop-after-epoch", 1], check=True)
    good = (out / "checkpoint.pt").read_bytes()
    proc = launch([*base, "--base-lr", 1e30], torchrun=False, check=False)  # a process: its exit is the point
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("error: the training loss was NaN or infinite in most fp16 steps since the last check"
            in proc.stderr)
    assert "--amp bf16" in proc.stderr
    assert (out / "checkpoint.pt").read_bytes() == good


def loader_workers_below(pid) -> list:
    """The DataLoader workers among the processes below `pid` (torch names them pt_data_worker)."""
    def name(p):
        try:
            with open(f"/proc/{p}/comm") as f:
                return f.read().strip()
        except OSError:
            return ""
    return [p for p in descendants(pid) if name(p) == "pt_data_worker"]


def test_a_bug_mid_training_keeps_its_traceback_and_frees_the_ddp_model_before_the_interpreter_finalizes(tmp_path):
    """A bug (a ValueError in rank 0's third step) is printed with its traceback, whose frames hold the DDP model
    (sys.last_traceback). Freed only in the interpreter's finalization, the model and its process group's threads
    can abort the process after the traceback; run_cli's atexit handler frees them while the interpreter is
    whole."""
    run = ["--dataset", "synthetic", "--train-size", 256, "--test-size", 64, "--batch-size", 32, "--epochs", 1,
           *TINY, "--device", "cpu", "--out-dir", tmp_path / "run"]
    proc = launch(run, nproc=2, script="tests/scripts/teardown_probe.py", env={"TEARDOWN_PROBE_BUG": "3"},
                  check=False)
    assert proc.returncode == 1, proc.stderr
    assert "ValueError: teardown probe: a bug in the training step" in proc.stderr, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr, proc.stderr
    assert "teardown probe: rank 0: 0 DDP models alive at exit" in proc.stderr, proc.stderr


@pytest.mark.parametrize("torchrun", [False, True], ids=["python", "torchrun"])
def test_a_rank_killed_with_sigkill_leaves_no_process_of_its_run(tmp_path, torchrun):
    """kill -9 of a training process mid-epoch (the OOM killer, Slurm after KillWait): its loader workers and
    their forkserver, which ignore the stop signals and are not its children, end with it; under torchrun the
    other rank's too. Nothing of the run is left."""
    out = tmp_path / "run"
    run = ["--dataset", "synthetic", "--train-size", 512, "--test-size", 64, "--batch-size", 16, "--epochs", 50,
           "--out-dir", out, "--log-every", 1, "--loader", "torch", *TINY, "--workers", 1]
    proc, log = start(run, nproc=2, torchrun=torchrun)
    wait_for(lambda: "step 1/" in text(log), what="the first step")
    ranks = launcher_and_ranks(proc)[1:] if torchrun else [proc.pid]
    wait_for(lambda: all(loader_workers_below(r) for r in ranks), what="each rank's loader workers")
    run_processes = every_process(proc)
    assert len(run_processes) >= 1 + 2 * len(ranks)  # the ranks, each with a forkserver and a worker
    os.kill(ranks[-1], signal.SIGKILL)
    assert proc.wait(timeout=300) != 0, text(log)
    wait_for(lambda: all(support.processes().get(p, ("X",))[0] in ("Z", "X") for p in run_processes),
             timeout=60, what="every process of the killed run to end")
