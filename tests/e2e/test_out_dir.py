"""One run per out-dir (run.lock, end to end): a second run on a busy out-dir is refused in one line
naming the owner, a run killed with kill -9 does not lock the next, and a run that lost its out-dir
to another stops every rank at its next write, in one line, writing nothing more. (The lock's rules
in-process: tests/unit/test_out_dir_lock.py.)"""
import json
import os
import re
import signal
import socket
import time

from support import (TINY, assert_one_line, kill_all, launcher_and_ranks, paused, read_jsonl, run_in_process,
                     start, text, wait_for)

TINY_SYNTH = ["--dataset", "synthetic", *TINY, "--device", "cpu"]
# 1600 / 32 = 50 steps per epoch.
RUN = ["--dataset", "synthetic", "--train-size", 1600, "--test-size", 64, "--batch-size", 32, "--epochs", 3,
       *TINY, "--device", "cpu", "--log-every", 0, "--keep-checkpoints", 3]


def test_a_second_run_on_a_busy_out_dir_is_refused_and_a_killed_run_does_not_lock_the_next(tmp_path):
    out = tmp_path / "run"
    run = [*TINY_SYNTH, "--train-size", 4000, "--test-size", 20, "--batch-size", 16, "--epochs", 2,
           "--workers", 0, "--out-dir", out, "--log-every", 10]
    proc, log = start(run, nproc=2)
    wait_for(lambda: "step 10/" in text(log) or proc.poll() is not None, what="the first run to train")
    assert proc.poll() is None, text(log)
    owner = json.loads((out / "run.lock").read_text())
    with paused(launcher_and_ranks(proc)):  # still running, however fast the machine, until killed
        second = run_in_process([*run, "--epochs", 3])
        kill_all(proc)  # kill -9 of torchrun and both ranks: no cleanup runs
    assert second.returncode == 2
    assert f"is in use by another run (host {socket.gethostname()}, pid {owner['pid']}" in second.stderr
    assert "use another --out-dir" in second.stderr and "Resumed" not in second.stdout
    assert (out / "run.lock").exists()
    third = run_in_process(run, check=True)  # one process: the lock is the point
    assert (f"note: took over {out}/run.lock from host {socket.gethostname()}, pid {owner['pid']}"
            in third.stdout)
    assert f"its process {owner['pid']} is gone" in third.stdout
    assert [m["epoch"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert not (out / "run.lock").exists()  # released at the end


def test_a_run_that_lost_its_out_dir_to_another_stops_every_rank_in_one_line(tmp_path):
    out = tmp_path / "run"
    common = [*RUN, "--checkpoint-every", 5, "--timeout", 90]
    first, first_log = start([*common, "--out-dir", out], nproc=2)
    wait_for(lambda: (out / "checkpoint.pt").exists(), what="the first checkpoint")
    ranks = launcher_and_ranks(first)[1:]
    for pid in ranks:  # paused between two checkpoints, while the second run starts and takes the lock
        os.kill(pid, signal.SIGSTOP)
    os.unlink(out / "run.lock")  # as the busy-out-dir message invites, "if it died"
    (tmp_path / "same").symlink_to(out)  # the same out-dir, by another name: the second run's log apart
    second, second_log = start([*common, "--out-dir", tmp_path / "same"], nproc=2)
    wait_for(lambda: (out / "run.lock").exists() or second.poll() is not None, what="the second run's lock")
    owner = json.loads((out / "run.lock").read_text())
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
    resumed = time.time()
    assert first.wait(timeout=60) != 0
    took = time.time() - resumed
    assert_one_line(text(first_log),
                    f"another run took over --out-dir {out} (host {owner['host']}, pid {owner['pid']}",
                    "so this one stops without writing there")
    print(f"lost lock: every rank out {took:.1f} s after it ran on")
    assert took < 30, took  # at its next checkpoint (5 steps), not after --timeout (90 s)
    assert ((out / "run.lock").exists()
            and json.loads((out / "run.lock").read_text())["token"] == owner["token"])
    # its lock and its checkpoints untouched by the first
    assert second.wait(timeout=300) == 0, text(second_log)
    assert "error: " not in text(second_log) and re.search(r"Resumed from .*checkpoint\.pt", text(second_log))
