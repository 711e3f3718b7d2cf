"""Ctrl-C, as a terminal sends it: the ranks agree within 10 steps, rank 0 checkpoints, exit 75, no
traceback, and the same command resumes there; a second Ctrl-C quits at once (exit 130) without a
checkpoint; under torchrun, which forwards it to ranks in sessions of their own, the same."""
import os
import signal

from support import TINY, launch, load_model_state, start, text, wait_for

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
    assert progress["step"] > 0 and progress["step"] % 10 == 0 and progress["position"] == 16 * progress["step"]
    assert progress["sums"][2] == progress["position"] < 4000  # both ranks' samples, mid-epoch
