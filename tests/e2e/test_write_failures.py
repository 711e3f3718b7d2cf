"""A write that fails mid-run (a full disk, on a real filesystem that really fills: a small tmpfs this
test mounts; a filesystem turned read-only) ends every rank within seconds with one line that says
what failed, why, and what is intact; the last checkpoint stays loadable, nothing is left
half-written, and after freeing space the same command resumes and ends with the metrics of an
uninterrupted run. Needs root (the tmpfs); skipped elsewhere."""
import json
import os
import re
import subprocess
import time

import pytest

from support import (TIMING_METRICS, TINY, assert_one_line, fill, launch, launch_forked, launcher_and_ranks,
                     load_model_state, paused, read_jsonl, run_in_process, start, text, wait_for)

# 1600 / 32 = 50 steps per epoch: an epoch lasts a few seconds on 2 cores, time for the test to fill the disk.
RUN = ["--dataset", "synthetic", "--train-size", 1600, "--test-size", 64, "--batch-size", 32, "--epochs", 3,
       *TINY, "--device", "cpu", "--log-every", 0, "--keep-checkpoints", 3]
TIMING = TIMING_METRICS  # the only metrics a resume may change


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (2 ranks under torchrun) whose metrics every interrupted and resumed one must end
    with; and how much epoch 2's checkpoint outgrows epoch 1's. (Under plain python: the mid-epoch test, with
    a reference of its own.)"""
    out = tmp_path_factory.mktemp("reference") / "run"
    launch_forked([*RUN, "--out-dir", out], nproc=2)
    # epochs 2, 1
    growth = os.path.getsize(out / "checkpoint.1.pt") - os.path.getsize(out / "checkpoint.2.pt")
    return read_jsonl(out / "metrics.jsonl"), growth


def without_timing(rows):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def run_until_write_fails(args, nproc, torchrun, when, leave, mount_point, script="train_ddp.py"):
    """Start the run, fill the disk once `when(out)` holds, and wait for the run to end; returns
    (exit status, output, seconds from the error line to the exit, the filler file)."""
    out = args[args.index("--out-dir") + 1]
    # off the small disk
    proc, log = start(args, nproc=nproc, torchrun=torchrun, log=mount_point.parent / "run.log", script=script)
    wait_for(lambda: when(out) or proc.poll() is not None, timeout=180, what="the moment to fill the disk")
    assert proc.poll() is None, text(log)
    with paused(launcher_and_ranks(proc)):  # the disk fills before the run's next write, however fast it goes
        filler = fill(mount_point, leave)
    error_seen = None
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        if error_seen is None and "error: " in text(log):
            error_seen = time.time()
        time.sleep(0.05)
    assert proc.poll() is not None, f"still running 120 s after the disk filled:\n{text(log)}"
    error_seen = error_seen or time.time()
    return proc.returncode, text(log), time.time() - error_seen, filler


def assert_nothing_half_written(out):
    left = [name for name in os.listdir(out)
            if name.endswith(".tmp") or name.startswith(".") or name == "run.lock"]
    assert not left, left  # no temporary files, and the lock released
    for line in open(out / "metrics.jsonl"):
        json.loads(line)  # every row whole: the next run reads them all


def metrics_rows(out):
    return len(read_jsonl(out / "metrics.jsonl")) if (out / "metrics.jsonl").exists() else 0


def test_full_disk_at_an_epoch_end_checkpoint_ends_every_rank_in_one_line_and_resumes(small_fs, reference):
    out = small_fs / "run"
    args = [*RUN, "--out-dir", out]
    # Filled while epoch 2 trains (epoch 1 recorded): its checkpoint, about 700 KB, cannot be written.
    status, output, exit_s, filler = run_until_write_fails(
        args, 2, True, lambda o: metrics_rows(o) == 1, 64 * 1024, small_fs)
    print(f"epoch-end checkpoint, torchrun: the last rank out {exit_s:.1f} s after the error line")
    assert status == 1 and exit_s < 10, (status, exit_s)  # torchrun's own 1 for the ranks' 74
    assert_one_line(output, f"error: no space left on device writing the checkpoint after epoch 2 in {out}; ",
                    f"the last good checkpoint, {out}/checkpoint.pt (after epoch 1), is intact: free space "
                    f"in {out}",
                    "then run the same command to resume")
    assert load_model_state(out)["progress"]["epoch"] == 1
    assert_nothing_half_written(out)

    filler.unlink()
    resumed = launch_forked(args, nproc=2)
    assert "Resumed from" in resumed.stdout and "Training completed successfully." in resumed.stdout
    assert without_timing(read_jsonl(out / "metrics.jsonl")) == without_timing(reference[0])


def test_a_failed_write_frees_every_ranks_ddp_model_before_destroying_the_process_group(small_fs):
    """Rank 0's failed write leaves its exception's frames, the DDP model among them, in a reference cycle. Freed
    only by the interpreter's last collection, after destroy_process_group, the model and the process group's
    threads can abort the process at exit (seen under srun: "terminate called without an active exception",
    status 134 instead of 74). The entry point collects them before it destroys the group."""
    out = small_fs / "run"
    status, output, _, _ = run_until_write_fails([*RUN, "--out-dir", out], 2, True,
                                                 lambda o: metrics_rows(o) == 1, 64 * 1024, small_fs,
                                                 script="tests/scripts/teardown_probe.py")
    failed = "error: no space left on device writing the checkpoint after epoch 2" in output
    assert (status, failed) == (1, True), output
    alive = re.findall(r"teardown probe: rank (\d+): (\d+) DDP models alive at destroy_process_group", output)
    assert sorted(alive) == [("0", "0"), ("1", "0")], output


def test_full_disk_at_a_mid_epoch_checkpoint_under_plain_python(small_fs):
    out, reference = small_fs / "run", small_fs.parent / "reference"
    # WRN-10-2 at batch 64: 10 steps between checkpoints take a few seconds, time to see the first and hold the
    # run still before the second; 30 steps, so checkpoints at steps 10 and 20, then the epoch's end.
    run = [*RUN, "--train-size", 1920, "--batch-size", 64, "--widen-factor", 2,
           "--checkpoint-every", 10, "--epochs", 1]
    run_in_process([*run, "--out-dir", reference], check=True)
    args = [*run, "--out-dir", out]
    status, output, exit_s, filler = run_until_write_fails(
        args, 1, False, lambda o: (o / "checkpoint.pt").exists(), 64 * 1024, small_fs)
    print(f"mid-epoch checkpoint, python: out {exit_s:.1f} s after the error line")
    assert status == 74 and exit_s < 10, (status, exit_s)
    line = assert_one_line(output,
                           "error: no space left on device writing the checkpoint at step 20 of epoch 1 in ",
                           f"the last good checkpoint, {out}/checkpoint.pt (at step 10 of epoch 1), "
                           f"is intact")
    progress = load_model_state(out)["progress"]
    assert (progress["epoch"], progress["step"]) == (0, 10), line
    assert_nothing_half_written(out)
    filler.unlink()
    resumed = run_in_process(args, check=True)
    assert "and 640 samples (10 steps) of the next." in resumed.stdout
    assert (without_timing(read_jsonl(out / "metrics.jsonl"))
            == without_timing(read_jsonl(reference / "metrics.jsonl")))


def test_full_disk_at_a_metrics_write_keeps_the_checkpoint_and_every_row_whole(small_fs, reference):
    out = small_fs / "run"
    args = [*RUN, "--out-dir", out]
    proc, log = start(args, nproc=2, log=small_fs.parent / "run.log")
    wait_for(lambda: metrics_rows(out) == 1 or proc.poll() is not None, timeout=180, what="epoch 2")
    # Leave exactly the pages epoch 2's checkpoint will take (epoch 1's, and the one more row of history
    # it holds), and not one for the metrics row written after it; --keep-checkpoints 3: no rotation frees
    # any.
    pages = -(-(os.path.getsize(out / "checkpoint.pt") + reference[1]) // 4096)
    with paused(launcher_and_ranks(proc)):  # the disk fills during epoch 2, however fast the machine is
        filler = fill(small_fs, pages * 4096)
    filled = time.time()
    assert proc.wait(timeout=120) != 0
    print(f"metrics write: every rank out {time.time() - filled:.1f} s after the disk filled (the rest of "
          f"epoch 2 included)")
    output = text(log)
    assert_one_line(output, f"error: no space left on device writing epoch 2's metrics in {out}; ",
                    f"the last good checkpoint, {out}/checkpoint.pt (after epoch 2), is intact")
    assert load_model_state(out)["progress"]["epoch"] == 2
    assert [m["epoch"] for m in read_jsonl(out / "metrics.jsonl")] == [1]  # the old file, whole
    assert_nothing_half_written(out)
    filler.unlink()
    launch_forked(args, nproc=2)  # the metrics of epoch 2 come back from the checkpoint's history
    assert without_timing(read_jsonl(out / "metrics.jsonl")) == without_timing(reference[0])


def test_full_disk_under_elastic_restarts_says_the_same_line_quickly_on_every_attempt(small_fs):
    out = small_fs / "run"
    proc, log = start([*RUN, "--out-dir", out], nproc=2, extra=["--max-restarts=2"],
                      log=small_fs.parent / "run.log")
    wait_for(lambda: metrics_rows(out) == 1 or proc.poll() is not None, timeout=180, what="epoch 1's end")
    with paused(launcher_and_ranks(proc)):  # the disk fills during epoch 2, however fast the machine is
        fill(small_fs, 64 * 1024)
    filled = time.time()
    assert proc.wait(timeout=120) != 0
    took = time.time() - filled
    errors = [line for line in text(log).splitlines() if line.startswith("error: ")]
    # The first attempt fails writing epoch 2's checkpoint; each restart resumes epoch 1's, finds no room
    # for the next at its start, and says so at once, before any work: 3 attempts, 3 lines.
    assert len(errors) == 3, text(log)
    assert all(e.startswith("error: no space left on device writing ") for e in errors), errors
    assert all("then run the same command to resume" in e for e in errors[1:])
    assert "a checkpoint of about" in errors[1] and errors[1] == errors[2]
    print(f"elastic, 3 attempts: all out {took:.1f} s after the disk filled")
    assert took < 60, took  # an epoch's work is not repeated on each attempt
    assert load_model_state(out)["progress"]["epoch"] == 1


def test_evaluate_on_a_full_disk_says_eval_json_could_not_be_written(small_fs):
    out = small_fs / "run"
    run_in_process([*RUN, "--out-dir", out, "--epochs", 1, "--train-size", 64], check=True)
    fill(small_fs, 0)
    proc = launch(["--evaluate", "--out-dir", out], torchrun=False, check=False)  # a process: its exit too
    assert proc.returncode == 74
    assert_one_line(proc.stdout + proc.stderr, "error: no space left on device writing eval.json in ",
                    f"the last good checkpoint, {out}/checkpoint.pt (after epoch 1), is intact")


def test_a_filesystem_turned_read_only_mid_run_is_named_and_the_checkpoint_kept(small_fs):
    out = small_fs / "run"
    proc, log = start([*RUN, "--out-dir", out], nproc=2, log=small_fs.parent / "run.log")
    wait_for(lambda: metrics_rows(out) == 1 or proc.poll() is not None, timeout=180, what="epoch 1's end")
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)  # as a failing Lustre OST does
    turned = time.time()
    assert proc.wait(timeout=120) != 0
    print(f"read-only: every rank out {time.time() - turned:.1f} s after the remount (the rest of epoch 2 "
          f"included)")
    assert_one_line(text(log),
                    f"error: read-only file system writing the checkpoint after epoch 2 in {out}; ",
                    f"the last good checkpoint, {out}/checkpoint.pt (after epoch 1), is intact: {out} is on "
                    f"a read-only filesystem: use another --out-dir")
    assert load_model_state(out)["progress"]["epoch"] == 1
