"""machinery.signals.StopRequest: its SIGUSR1/SIGTERM/SIGINT handlers are installed only inside `with` and the
previous ones restored after; a signal or the stop file inside is a stop request, named in `reason`;
and train_utils.LossCheck's policy on non-finite losses (any, without fp16's grad scaler; a majority since
the last check, with it); and a rank leaving with an agreed error keeps its exit status through the launcher's
SIGTERM."""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from machinery.errors import UserError
from machinery.signals import StopRequest
from train_utils import EPOCH_SUMS, LossCheck
from support import ROOT, SCRIPTS, python_path

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def test_handlers_are_installed_inside_with_and_the_previous_ones_restored_after():
    def mine(signum, frame):
        pass
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        signal.signal(signal.SIGUSR1, mine)  # a handler of the caller's own: it must come back
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        stop = StopRequest()
        assert {sig: signal.getsignal(sig) for sig in SIGNALS} == previous  # creating one installs nothing
        with stop as entered:
            assert entered is stop
            for sig in SIGNALS:
                handler = signal.getsignal(sig)
                assert handler != previous[sig] and getattr(handler, "__self__", None) is stop, sig
        assert {sig: signal.getsignal(sig) for sig in SIGNALS} == previous
        with pytest.raises(RuntimeError):  # restored on the way out of an exception too
            with StopRequest():
                raise RuntimeError
        assert {sig: signal.getsignal(sig) for sig in SIGNALS} == previous
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_inside_is_a_stop_request_named_in_reason(sig, monkeypatch):
    monkeypatch.delenv("DDP_STOP_FILE", raising=False)
    before = signal.getsignal(sig)
    with StopRequest() as stop:
        assert not stop.requested_here() and stop.reason == "on another rank"  # nothing here: another rank's
        os.kill(os.getpid(), sig)
        assert stop.requested_here() and stop.reason == sig.name
        assert stop.check(torch.device("cpu")) is True
    assert signal.getsignal(sig) == before


def test_the_stop_file_is_a_stop_request(tmp_path, monkeypatch):
    stop_file = tmp_path / "stop"
    monkeypatch.setenv("DDP_STOP_FILE", str(stop_file))
    with StopRequest() as stop:
        assert stop.check(torch.device("cpu")) is False
        stop_file.touch()
        assert stop.check(torch.device("cpu")) is True
        assert stop.reason == f"stop file {stop_file}"


def test_nonfinite_loss_policy():
    """Without a grad scaler any non-finite loss stops the run; with fp16's scaler, which skips those steps,
    only a majority of them since the previous check (divergence) does. The counts are read by name from the
    epoch's sums (EPOCH_SUMS), a device tensor mid-epoch or a list at its end."""
    cpu = torch.device("cpu")

    def sums(bad_steps, steps):  # the epoch's sums after `steps` steps of 32 samples, `bad_steps` non-finite
        values = dict.fromkeys(EPOCH_SUMS, 0.0)
        values.update(loss_sum=1.0, finite_samples=(steps - bad_steps) * 32.0, samples=steps * 32.0)
        return torch.tensor([values[k] for k in EPOCH_SUMS])
    LossCheck(cpu, allow_nonfinite=False).check(sums(0, 10))
    LossCheck(cpu, allow_nonfinite=False).check(sums(0, 10).tolist())
    with pytest.raises(UserError, match="became NaN or infinite"):
        LossCheck(cpu, allow_nonfinite=False).check(sums(1, 10))
    with pytest.raises(UserError, match="became NaN or infinite"):
        LossCheck(cpu, allow_nonfinite=False).check(sums(1, 10).tolist())
    fp16 = LossCheck(cpu, allow_nonfinite=True)
    fp16.check(sums(4, 10))  # overflows the scaler skips
    fp16.check(sums(8, 20))  # 4 of the last 10
    with pytest.raises(UserError, match="most fp16 steps since the last check"):
        fp16.check(sums(14, 30))  # 6 of the last 10, though 14 of all 30
    fp16 = LossCheck(cpu, allow_nonfinite=True)
    fp16.check(sums(0, 90))
    with pytest.raises(UserError, match="most fp16 steps"):
        fp16.check(sums(10, 100))  # diverged: caught within 10 steps, not after half an epoch
    fp16.check(sums(2, 10))  # a new epoch restarts the sums


def test_loader_workers_are_born_holding_the_stop_signals_then_ignore_them_and_end_with_their_process():
    """A stop signal sent to every process (Slurm, timeout) must not kill a loader worker, even one still
    starting up: it is born holding them back (the first worker's resource tracker unblocks SIGINT and SIGTERM
    in the rank, so the hold is taken again), then ignores them. And a worker that ignores SIGTERM still ends
    with its process, whose loader may outlive multiprocessing's exit handler (which would wait for it for
    ever)."""
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "worker_signal_mask.py")], cwd=ROOT,
                          timeout=120, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": python_path(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(report["born_holding"]) == sorted(report["ignores"]) == sorted(int(s) for s in SIGNALS)


ORIGINAL_WORKERS = """
import json, multiprocessing, os, signal, types
import torch
multiprocessing.set_start_method("fork")  # DataLoader's default on Linux before Python 3.14, the one forked here
from machinery.signals import STOP_SIGNALS
from tools.original_script import original_batches
born = os.pipe()
def report():  # in each forked worker, before anything of multiprocessing's or torch's runs
    held = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    os.write(born[1], (json.dumps(held) + "\\n").encode())
os.register_at_fork(after_in_child=report)
data = types.SimpleNamespace(images=torch.zeros(8, 3, 32, 32, dtype=torch.uint8), labels=torch.zeros(8).long())
env = types.SimpleNamespace(world_size=1, rank=0)
batches = original_batches(data, 2, env, 2, torch.device("cpu"))
next(batches)
batches.close()
lines = b""
while lines.count(b"\\n") < 2:  # each worker writes once, maybe after its start() returned here
    lines += os.read(born[0], 1 << 16)
masks = [json.loads(line) for line in lines.decode().splitlines()]
stop = {int(s) for s in STOP_SIGNALS}
print(json.dumps({"workers": len(masks), "born_holding": [sorted(set(m) & stop) for m in masks]}))
"""


def test_the_original_pipelines_workers_bench_times_are_born_holding_the_stop_signals():
    """bench.py --compare-original's DataLoader workers (the fork start method) take the recipe's guard: a Ctrl-C
    to the process group while one is forking must not reach its Python (a KeyboardInterrupt traceback)."""
    proc = subprocess.run([sys.executable, "-c", ORIGINAL_WORKERS], cwd=ROOT, timeout=120, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": python_path(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["workers"] == 2 and report["born_holding"] == [sorted(int(s) for s in SIGNALS)] * 2, report


LEAVING = """
import os, signal, sys
import torch.distributed as dist
from machinery.errors import WriteError, leave_on_user_error
store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)  # a free port
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
status = leave_on_user_error(WriteError("no space left on device"))
os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, as the first rank out makes srun or torchrun send it
print("still leaving", flush=True)
dist.destroy_process_group()
sys.exit(status)
"""


def test_a_rank_leaving_with_an_agreed_error_keeps_its_status_when_the_launcher_sends_sigterm():
    """Once the ranks agree on a UserError, each leaves with its status (74: a failed write); the launcher's
    SIGTERM (srun --kill-on-bad-exit, torchrun), sent when the first one is out, does not turn a rank still
    on its way out into "Terminated" (143, the job's status with it)."""
    proc = subprocess.run([sys.executable, "-c", LEAVING], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": python_path(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 74, (proc.returncode, proc.stderr)
    ours = [line for line in proc.stdout.splitlines() if not line.startswith("[Gloo] ")]  # torch 2.8's own
    assert ours == ["still leaving"] and "error: no space left on device" in proc.stderr


@pytest.mark.parametrize("worker", [True, False], ids=["loader worker", "plain process"])
def test_a_rank_leaving_mid_handshake_leaves_no_traceback_in_its_loader_worker(worker):
    """A batch's storage reaches the rank as a file descriptor after a handshake with the worker's resource_sharer
    thread; a tool stopped at once by Ctrl-C (bench.py) breaks it off. A loader worker stays quiet, where a plain
    process (the same thread without the worker's hook) prints multiprocessing's traceback."""
    proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "sharer_peer_left.py"),
                             "worker" if worker else "plain"], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": python_path(ROOT)})
    address = proc.stdout.readline().rstrip("\n")
    with socket.socket(socket.AF_UNIX) as rank:  # connects, then leaves before the handshake's answer
        rank.connect(address)
    _, err = proc.communicate("left\n", timeout=60)
    assert proc.returncode == 0, err
    if worker:
        assert err == "", err
    else:
        assert "Traceback" in err and "resource_sharer.py" in err, err
