"""The stop signals as they really come. Ctrl-C, as a terminal sends it: the ranks agree within 10 steps, rank
0 checkpoints, exit 75, no traceback, and the run resumes there; a second Ctrl-C quits at once (exit
130) without a checkpoint; under torchrun, which forwards it to ranks in sessions of their own, the same.
SIGTERM or SIGUSR1 sent to every process of a run at once (launcher, ranks, loader workers), as Slurm,
`timeout` and container runtimes do: the same stop, nothing of the workers printed, and the resumed run ends
with the uninterrupted run's weights. (The job scripts under Slurm: test_slurm_jobs.py.)"""
import os
import re
import signal

import pytest
import torch

from support import (CKPT_RUN, TINY, assert_same_weights, command_line, every_process, launch_forked,
                     load_model_state, paused, processes, run_in_process, start, text, wait_for)

TINY_SYNTH = ["--dataset", "synthetic", *TINY, "--device", "cpu"]


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
    # At a check (every 10 steps), the first after the signal: step 10's own, if the signal came between its
    # line and its check (on a loaded machine it can), or a later one.
    assert step % 10 == 0 and step >= 10
    # the same command, in this process (without the worker, which changes nothing: test below)
    resumed = run_in_process([*run, "--workers", 0, "--out-dir", tmp_path / "once"], check=True)
    assert (f"({step} steps) of the next" in resumed.stdout
            and "Training completed successfully." in resumed.stdout)

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


def test_ctrl_c_under_torchrun_reaches_every_rank_and_they_stop_together_with_a_checkpoint(tmp_path):
    """torchrun's ranks run in sessions of their own: a Ctrl-C reaches torchrun, which forwards it to each
    rank; they agree, rank 0 checkpoints mid-epoch (every rank's samples counted), then torchrun prints
    its own SignalException report and exits 1; no traceback of ours."""
    out = tmp_path / "run"
    run = [*TINY_SYNTH, "--train-size", 4000, "--test-size", 20, "--batch-size", 16, "--epochs", 1,
           "--workers", 0, "--log-every", 10, "--out-dir", out]
    proc, log = start(run, nproc=2)
    wait_for(lambda: "step 10/" in text(log), what="training")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 1  # torchrun's own status after a signal
    output = text(log)
    assert output.count("closing signal SIGINT") == 2  # forwarded to both ranks
    assert output.count("Stop requested (SIGINT) in epoch 1 after step") == 1  # said once, by rank 0
    assert "SignalException" in output
    assert "train_ddp.py" not in "".join(ln for ln in output.splitlines() if ln.startswith("  File"))
    progress = load_model_state(out)["progress"]
    assert (progress["step"] > 0 and progress["step"] % 10 == 0
            and progress["position"] == 16 * progress["step"])
    assert progress["sums"][2] == progress["position"] < 4000  # both ranks' samples, mid-epoch


@pytest.fixture(scope="module")
def uninterrupted_one_rank(tmp_path_factory):
    """CKPT_RUN uninterrupted in one process, this one (conftest's `uninterrupted`: on 2 ranks)."""
    out = tmp_path_factory.mktemp("one_rank") / "run"
    run_in_process([*CKPT_RUN, "--out-dir", out], check=True)
    return load_model_state(out)


def loader_workers(pids) -> int:
    """How many of `pids` are DataLoader workers: forked by a rank's forkserver (whose command line they
    keep), so a forkserver process whose parent is one too."""
    def forkserver(pid):
        return b"multiprocessing.forkserver" in command_line(pid)
    table = processes()
    return sum(forkserver(pid) and forkserver(table[pid][1]) for pid in pids if pid in table)


# jobs/lib.sh's setting: torchrun (torch >= 2.9) forwards SIGUSR1 to the ranks as it does SIGTERM, instead of
# dying of it.
TORCHRUN_FORWARDS_USR1 = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
TORCH_2_9 = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9)


# Three runs, each part of the claim at least once: torchrun and plain python, both loaders, loader workers
# under each launcher, SIGTERM and SIGUSR1.
@pytest.mark.parametrize("nproc, loader, workers, sig", [
    pytest.param(2, "gpu", 0, signal.SIGTERM, id="torchrun-gpu_loader-TERM"),
    # torchrun forwards SIGUSR1 from torch 2.9 on; before, the same run gets SIGTERM (torchrun and workers)
    pytest.param(2, "torch", 2, signal.SIGUSR1 if TORCH_2_9 else signal.SIGTERM,
                 id="torchrun-torch_loader-2_workers-USR1"),
    pytest.param(1, "torch", 2, signal.SIGTERM, id="python-torch_loader-2_workers-TERM"),
])
def test_a_stop_signal_to_every_process_checkpoints_and_resumes_to_the_uninterrupted_weights(
        nproc, loader, workers, sig, tmp_path, uninterrupted, request):
    """The signal reaches the loader workers as well as the ranks (the bug: a worker killed by it took its
    rank down with "DataLoader worker ... is killed by signal" before any checkpoint). `--loader gpu` (on the
    CPU here) has no workers: the other loader, the same stop. Under torchrun the ranks get it twice (torchrun
    forwards its own), which changes nothing."""
    reference = (request.getfixturevalue("uninterrupted_device_loader") if loader == "gpu"
                 else uninterrupted if nproc == 2 else request.getfixturevalue("uninterrupted_one_rank"))
    out = tmp_path / "run"
    run = [*CKPT_RUN, "--loader", loader, "--workers", workers, "--out-dir", out]
    proc, log = start(run, nproc=nproc, torchrun=nproc > 1, env=TORCHRUN_FORWARDS_USR1)
    wait_for(lambda: "Epoch 1/2 completed" in text(log) or proc.poll() is not None, what="epoch 1's end")
    pids = every_process(proc)
    # The training and test loaders' persistent workers of every rank are among the processes signalled.
    assert loader_workers(pids) == 2 * workers * nproc, text(log)
    with paused(pids):  # lands in epoch 2 however fast the machine is
        for pid in pids:
            os.kill(pid, sig)
    assert proc.wait(timeout=120) == (75 if nproc == 1 else 1)  # torchrun reports the ranks' 75 as its own 1
    output = text(log)
    assert output.count(f"Stop requested ({sig.name}) in epoch 2 after step") == 1, output
    assert "DataLoader worker" not in output and "killed by signal" not in output, output
    # no traceback of ours
    assert not re.search(r'(train_ddp|train_utils|dataset_utils|machinery/\w+)\.py", line', output)
    progress = load_model_state(out)["progress"]
    assert progress["epoch"] == 1 and 0 < progress["position"] < 640, progress  # mid-epoch 2
    # The same command without the workers (they change nothing: the uninterrupted runs have none), on forked
    # ranks, or in one process, this one.
    without_workers = [*run, "--workers", 0]
    resumed = (launch_forked(without_workers, nproc=nproc) if nproc > 1
               else run_in_process(without_workers, check=True))
    assert f"Resumed from {out}/checkpoint.pt: epoch 1 of 2 done" in resumed.stdout
    assert_same_weights(out, reference)
