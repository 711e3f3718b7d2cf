"""The job scripts in jobs/, submitted unmodified with sbatch to a real (local) Slurm cluster.

tests/slurm/setup_cluster.sh starts it: slurmctld and two slurmd (node1, node2) on 127.0.0.1,
with placeholder GPUs as a GRES, so Slurm grants --gpus and sets SLURM_GPUS_ON_NODE; without
CUDA the ranks train on CPU with gloo. It needs root; elsewhere these tests are skipped.
"""
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TINY, job_recipe, launch, load_model_state, read_json

SETUP = os.path.join(ROOT, "tests", "slurm", "setup_cluster.sh")
# The job scripts' #SBATCH defaults ask for a real GPU node; only what this host lacks is overridden.
SMALL_NODE = ["--mem=2G", "--cpus-per-task=1", "--time=00:15:00"]
TRAIN = ["--dataset", "synthetic", "--train-size", 256, "--test-size", 64, "--batch-size", 32, "--epochs", 2, *TINY]


@pytest.fixture(scope="session")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("starting a local Slurm cluster needs root (tests/slurm/setup_cluster.sh)")
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        pytest.skip("no Slurm here, and no apt-get to install it")
    proc = subprocess.run(["bash", SETUP], capture_output=True, text=True, timeout=1200)
    if proc.returncode == 3:  # a real cluster's slurm.conf is here: leave it alone
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, f"local Slurm cluster failed to start:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def sbatch(script, tmp_path, sbatch_args, train_args):
    """Submit jobs/<script> as a user would, from the project directory; returns (job id, log path)."""
    log = tmp_path / f"{script}.log"
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    cmd = ["sbatch", "--parsable", f"--output={log}", f"--error={log}", *SMALL_NODE, *sbatch_args,
           os.path.join("jobs", script), *map(str, train_args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0], log


def job_field(job_id, field):
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    for item in out.split():
        if item.startswith(field + "="):
            return item.split("=", 1)[1]
    return None


def wait_job(job_id, log, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_field(job_id, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not finish in {timeout} s:\n{read(log)}")


def read(path):
    return open(path).read() if os.path.exists(path) else ""


def test_multigpu_job_uses_every_granted_gpu(slurm, tmp_path):
    out = tmp_path / "run"
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=2"], [*TRAIN, "--out-dir", out])
    assert wait_job(job, log) == "COMPLETED", read(log)
    text = read(log)
    assert "GPUs on this node: 2" in text and "torchrun: 1 node x 2 processes" in text
    assert "Training completed successfully." in text
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["gpus_per_node"] == 2 and summary["nodes"] == 1
    # The job runs the recipe of jobs/lib.sh (printed at the start), and the arguments after the script win.
    assert "=== recipe (jobs/lib.sh): --depth 16 --widen-factor 8" in text
    config = summary["config"]
    assert config["nesterov"] and config["lr_schedule"] == "step" and config["reference_batch_size"] == 128
    assert (config["depth"], config["epochs"], config["batch_size"]) == (10, 2, 32)
    assert summary["epochs_completed"] == 2 and summary["finished"] is True


def test_multinode_job_spans_both_nodes(slurm, tmp_path):
    out = tmp_path / "run"
    job, log = sbatch("multinode.sh", tmp_path, ["--nodes=2", "--gpus-per-node=2"], [*TRAIN, "--out-dir", out])
    assert wait_job(job, log) == "COMPLETED", read(log)
    text = read(log)
    assert "torchrun: 2 nodes x 2 processes, rendezvous at node1:" in text
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 4 == 2 * summary["gpus_per_node"]
    assert summary["nodes"] == 2 and summary["hosts"] == ["node1", "node2"]
    assert summary["finished"] is True


def test_srun_direct_without_torchrun(slurm, tmp_path):
    out = tmp_path / "run"
    job, log = sbatch("srun_direct.sh", tmp_path, ["--ntasks-per-node=2", "--gpus-per-task=1"],
                      [*TRAIN, "--out-dir", out])
    assert wait_job(job, log) == "COMPLETED", read(log)
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["gpus_per_node"] == 2 and summary["finished"] is True
    assert "Training started with 2 processes across 1 nodes." in read(log)


def test_preempted_job_checkpoints_requeues_and_resumes_to_the_same_weights(slurm, tmp_path):
    train = [*TRAIN[:2], "--train-size", 1536, *TRAIN[4:], "--dropout", 0.1]
    out = tmp_path / "run"
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=2"], [*train, "--out-dir", out])
    deadline = time.time() + 300
    while "Global batch" not in read(log):
        assert time.time() < deadline and job_field(job, "JobState") in ("PENDING", "RUNNING"), read(log)
        time.sleep(0.5)
    time.sleep(2)
    # Slurm's time-limit warning (--signal=B:USR1@180) or a preemption notice, sent by hand.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    assert wait_job(job, log, timeout=900) == "COMPLETED", read(log)
    text = read(log)
    assert "signal received: asking the ranks to checkpoint and stop" in text
    assert "Stop requested (stop file" in text and "exiting with status 75" in text
    assert f"requeueing job {job}" in text and "(restart 1)" in text
    assert "Resumed from" in text and "Training completed successfully." in text
    assert not [f for f in os.listdir(ROOT) if f.startswith(".ddp-stop-")]  # the stop file is cleaned up

    reference = tmp_path / "reference"
    launch([*job_recipe(), *train, "--out-dir", reference], nproc=2)  # what the job ran: its recipe, then ours
    a, b = load_model_state(out), load_model_state(reference)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_preflight_job_checks_both_nodes(slurm, tmp_path):
    job, log = sbatch("preflight.sh", tmp_path, ["--nodes=2", "--gpus-per-node=1"],
                      ["--dataset", "synthetic", "--out-dir", tmp_path / "out", "--device", "cpu"])
    assert wait_job(job, log) == "COMPLETED", read(log)
    text = read(log)
    assert "world size 2" in text and "all_reduce bus bandwidth: 1 MiB" in text
    assert {h for h in ("node1", "node2") if f" {h} " in text} == {"node1", "node2"}
    assert "preflight: all checks passed" in text


def test_scaling_job_benchmarks_each_size_and_plots(slurm, tmp_path, monkeypatch):
    monkeypatch.setenv("PER_GPU_BATCH", "16")
    monkeypatch.setenv("SCALING_DIR", str(tmp_path / "results"))
    job, log = sbatch("scaling.sh", tmp_path, ["--nodes=2", "--gpus-per-node=2"],
                      ["--", "--depth", 10, "--widen-factor", 1, "--steps", 3, "--warmup", 1, "--device", "cpu"])
    assert wait_job(job, log) == "COMPLETED", read(log)
    results = {f: read_json(tmp_path / "results" / f) for f in ("1x1.json", "1x2.json", "2x2.json")}
    assert [r["world_size"] for r in results.values()] == [1, 2, 4]
    assert [r["config"]["batch_size"] for r in results.values()] == [16, 32, 64]  # fixed per-GPU batch
    assert (tmp_path / "results" / "scaling.png").stat().st_size > 10_000


def test_job_scripts_pass_shellcheck():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = sorted(os.path.join(ROOT, "jobs", f) for f in os.listdir(os.path.join(ROOT, "jobs")) if f.endswith(".sh"))
    proc = subprocess.run(["shellcheck", "-S", "warning", "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
