"""Elastic training: two torchrun agents on 127.0.0.1 meet through c10d rendezvous (`--nnodes=1:2`),
as two nodes would. When one agent and its rank are killed (kill -9, a lost node), the survivor is
restarted by torchrun at world size 1 and finishes; when a second agent joins a run of one, the run
grows to world size 2. Either way every epoch covers every sample once, the global batch and the LR
schedule stay, and the parameters end where an uninterrupted run's end (--micro-batch keeps
world_size x accumulation steps = 2, so it is the same math)."""
import os
import re
import signal
import socket
import subprocess

import pytest

from support import (ROOT, STARTED, TINY, TORCHRUN, assert_close_models, launcher_and_ranks, load_model_state,
                     read_jsonl, run_in_process, text, wait_for)

# 2400 samples, global batch 60: 40 steps per epoch, a checkpoint every 5 of them. Epochs of a few
# seconds leave time for a second agent to start (a few seconds of imports) while the run is going on.
N_TRAIN = 2400
RUN = ["--dataset", "synthetic", "--train-size", N_TRAIN, "--test-size", 100, "--batch-size", 60,
       "--epochs", 3, "--micro-batch", 30, "--base-lr", 0.4, "--warmup-epochs", 0.5, "--checkpoint-every", 5,
       "--log-every", 5, *TINY, "--device", "cpu"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """RUN uninterrupted in one process (2 accumulation steps of 30: the same math as 2 ranks x 30)."""
    out = tmp_path_factory.mktemp("elastic") / "reference"
    run_in_process([*RUN, "--out-dir", out], check=True)
    return load_model_state(out)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(out, port, name):
    """One `torchrun --nnodes=1:2` agent with one rank, as jobs/multinode.sh starts one per node."""
    cmd = [*TORCHRUN, "--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=elastic-{port}", "--max-restarts=3",
           "--rdzv_conf=last_call_timeout=2",  # how long a shrunk or grown rendezvous waits for more nodes
           os.path.join(ROOT, "train_ddp.py"), *[str(a) for a in RUN], "--out-dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # as jobs/multinode.sh sets it (see there)
    log = f"{out}.{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    STARTED.append(proc)
    return proc, log


def wait_for_store(port):
    """The first agent hosts the rendezvous store (the endpoint's host, as on Slurm's first node)."""
    def listening():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_for(listening, timeout=60, what="the first agent's rendezvous store")


def kill_agent_and_ranks(proc):
    for pid in launcher_and_ranks(proc):
        os.kill(pid, signal.SIGKILL)
    proc.wait()


def logs(*paths):
    return "".join(text(p) for p in paths)


def assert_every_epoch_complete(out, epochs=3):
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == list(range(1, epochs + 1))
    assert all(m["train_samples"] == N_TRAIN for m in metrics)  # every sample once per epoch, none twice


def test_losing_a_node_mid_epoch_the_survivor_finishes_at_world_size_1(tmp_path, reference):
    out, port = tmp_path / "run", free_port()
    a, log_a = start_agent(out, port, "a")
    wait_for_store(port)
    b, log_b = start_agent(out, port, "b")
    wait_for(lambda: "epoch 2 step 10/40" in logs(log_a, log_b), timeout=240, what="epoch 2, step 10")
    kill_agent_and_ranks(b)  # the node is gone: its agent and its rank
    assert a.wait(timeout=300) == 0, text(log_a)
    output = text(log_a)
    assert re.search(r"error: rank \d: lost another rank \(its process or node died\)", output)
    assert "Global batch 60 = 1 ranks x 2 accumulation steps x 30" in output
    assert "note: 2 ranks x 1 accumulation steps x 30 before, 1 x 2 x 30 now: the same global batch" in output
    assert "Training completed successfully." in output
    assert_every_epoch_complete(out)
    assert_close_models(reference, load_model_state(out))


def test_a_node_joining_grows_the_run_to_world_size_2(tmp_path, reference):
    out, port = tmp_path / "run", free_port()
    a, log_a = start_agent(out, port, "a")
    wait_for(lambda: "epoch 1 step 5/40" in text(log_a), timeout=240, what="epoch 1, step 5 at world size 1")
    b, log_b = start_agent(out, port, "b")
    assert a.wait(timeout=300) == 0 and b.wait(timeout=60) == 0, logs(log_a, log_b)
    output = logs(log_a, log_b)
    # torchrun stops the ranks with SIGTERM to let the new node in: a checkpointed stop, nothing lost.
    assert "Stop requested (SIGTERM) in epoch" in output
    assert "Global batch 60 = 2 ranks x 30" in output
    assert "note: 1 ranks x 2 accumulation steps x 30 before, 2 x 1 x 30 now: the same global batch" in output
    assert "Training completed successfully." in output
    assert_every_epoch_complete(out)
    assert_close_models(reference, load_model_state(out))
