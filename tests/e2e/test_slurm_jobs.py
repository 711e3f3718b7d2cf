"""The job scripts in jobs/, submitted unmodified with sbatch to a real (local) Slurm cluster.

tests/slurm/setup_cluster.sh starts it: slurmctld and two slurmd (node1, node2), each node in a
network namespace of its own with its own address (tests/slurm/cluster_net.sh), so that ranks on
different nodes meet only across the nodes' addresses, as on separate hosts; placeholder GPUs as
a GRES, so Slurm grants --gpus and sets SLURM_GPUS_ON_NODE; without CUDA the ranks train on CPU
with gloo. It needs root (and network namespaces); elsewhere these tests are skipped.
"""
import datetime
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import (ROOT, TINY, assert_same_weights, fill, job_recipe, launch_forked, load_model_state,
                     paused, read_json, read_jsonl, torchrun_root_cause, wait_for, write_cifar100)

SETUP = os.path.join(ROOT, "tests", "slurm", "setup_cluster.sh")
# As in tests/slurm/cluster_net.sh: each node's address, and node2's own /etc/hosts.
NODE_ADDR = {"node1": "10.213.0.1", "node2": "10.213.0.2"}
NODE2_HOSTS = "/etc/netns/slurmtest-node2/hosts"
# The job scripts' #SBATCH defaults ask for a real GPU node; only what this host lacks is overridden.
SMALL_NODE = ["--mem=2G", "--cpus-per-task=1", "--time=00:15:00"]
# The placeholder GPUs are not CUDA devices: the job scripts refuse to train on the CPU unless asked to.
CPU = ["--device", "cpu"]
TRAIN = ["--dataset", "synthetic", "--train-size", 256, "--test-size", 64, "--batch-size", 32, "--epochs", 2,
         *TINY, *CPU]


@pytest.fixture(scope="session")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("starting a local Slurm cluster needs root (tests/slurm/setup_cluster.sh)")
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        pytest.skip("no Slurm here, and no apt-get to install it")
    proc = subprocess.run(["bash", SETUP], capture_output=True, text=True, timeout=1200)
    # 3: a real cluster's slurm.conf, or a namespace, link or subnet of the same name, is here: leave it
    # alone.
    # 4: no network namespaces here (no CAP_NET_ADMIN).
    if proc.returncode in (3, 4):
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, (f"local Slurm cluster failed to start:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")


def sbatch(script, tmp_path, sbatch_args, train_args, env=None):
    """Submit jobs/<script> as a user would, from the project directory, with `env` exported to the
    job (sbatch passes the submitting environment on); returns (job id, log path). The job's threads are its
    own (srun_direct.sh: one per CPU of the task) unless `env` names them: OMP_NUM_THREADS is not passed on
    from here."""
    log = tmp_path / f"{script}.log"
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **(env or {})}
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


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")  # Slurm's final job states; the others (PENDING, RUNNING, COMPLETING, REQUEUED...) pass


def wait_job(job_id, log, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_field(job_id, "JobState")
        if state in ENDED:
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not finish in {timeout} s:\n{read(log)}")


def wait_for_line(job_id, log, line, timeout=300):
    """Wait until the job's log holds `line`; fail at once if the job ends first (a requeue's passing states,
    COMPLETING and REQUEUED, are not an end)."""
    deadline = time.time() + timeout
    while line not in read(log):
        assert time.time() < deadline and job_field(job_id, "JobState") not in ENDED, read(log)
        time.sleep(0.2)


def cleanup_step(job_id):
    """The id (JOB.STEP) of the job's STAGE_DATA cleanup step (jobs/lib.sh names it ddp-staged-copy), once
    Slurm lists it."""
    def listed():
        steps = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True, text=True)
        return [step for step, name in (line.split() for line in steps.stdout.splitlines())
                if name == "ddp-staged-copy"]
    wait_for(lambda: len(listed()) == 1, what="the cleanup step listed by squeue")
    return listed()[0]


def training_pids(out, log):
    """The job's training processes: torchrun and its ranks, or srun's tasks (those with `out` on their
    command line)."""
    pids = [int(p) for p in subprocess.run(["pgrep", "-f", f"train_ddp.py .*{out}"], capture_output=True,
                                           text=True).stdout.split()]
    assert pids, read(log)
    return pids


def read(path):
    return open(path).read() if os.path.exists(path) else ""


def run_seconds(job_id):
    """How long the job ran, from Slurm's StartTime to its EndTime."""
    start, end = (datetime.datetime.fromisoformat(job_field(job_id, f)) for f in ("StartTime", "EndTime"))
    return (end - start).total_seconds()


# no Python environment with torch
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VENV = os.path.join(ROOT, ".venv")


@pytest.fixture(scope="module")
def multigpu_job(slurm, tmp_path_factory):
    """jobs/multigpu.sh on 2 GPUs, submitted as users do from a shell that never activated the environment
    (PATH without torch) when the project has its .venv (the README's set-up makes it; CI does): (its log's
    text, the out-dir). Read by the two tests below."""
    tmp_path = tmp_path_factory.mktemp("multigpu")
    out = tmp_path / "run"
    bare = os.path.exists(os.path.join(VENV, "bin", "torchrun"))
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=2"], [*TRAIN, "--out-dir", out],
                      env={"PATH": SYSTEM_PATH} if bare else None)
    assert wait_job(job, log) == "COMPLETED", read(log)
    return read(log), out


def test_multigpu_job_uses_every_granted_gpu(multigpu_job):
    text, out = multigpu_job
    assert "GPUs on this node: 2" in text and "torchrun: 1 node x 2 processes" in text
    assert "Training completed successfully." in text
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["processes_per_node"] == 2 and summary["nodes"] == 1
    # The job runs the wrn-paper preset (named at the start), and the arguments after the script win.
    config = summary["config"]
    assert "=== recipe: --recipe wrn-paper" in text and config["recipe"] == "wrn-paper"
    assert config["nesterov"] and config["lr_schedule"] == "step" and config["reference_batch_size"] == 128
    assert (config["depth"], config["epochs"], config["batch_size"]) == (10, 2, 32)
    assert summary["epochs_completed"] == 2 and summary["finished"] is True


def test_job_without_torchrun_on_path_uses_the_project_s_venv(multigpu_job):
    """Submitted from a shell that never activated the environment: the job finds the project's .venv."""
    if not os.path.exists(os.path.join(VENV, "bin", "torchrun")):
        pytest.skip("no .venv in the project (the README's set-up makes it; CI does)")
    assert shutil.which("torchrun", path=SYSTEM_PATH) is None
    text, _ = multigpu_job
    assert f"python: {VENV}/bin/python" in text and "Training completed successfully." in text


def test_job_without_any_torch_environment_fails_at_once_in_one_line(slurm, tmp_path):
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=2"], [*TRAIN, "--out-dir", tmp_path / "run"],
                      env={"PATH": SYSTEM_PATH, "VENV": str(tmp_path / "no-venv")})
    assert wait_job(job, log) == "FAILED", read(log)
    errors = [line for line in read(log).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no torchrun on PATH" in errors[0] and "VENV=" in errors[0], read(log)
    assert "Training started" not in read(log) and job_field(job, "ExitCode") == "2:0"


def test_a_refused_run_s_one_line_ends_the_job_s_log_and_names_torchrun_s_root_cause(slurm, tmp_path):
    """The ranks refuse in one `error:` line; torchrun's failure report (tens of lines) follows it, with that
    line as its root cause, and the job script prints it again last: what a `tail` of the log shows."""
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=2"], [*TRAIN, "--batch-size", 63,
                                                              "--out-dir", tmp_path / "run"])
    assert wait_job(job, log) == "FAILED", read(log)
    errors = [line for line in read(log).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--batch-size 63 must be a positive multiple" in errors[0], read(log)
    assert torchrun_root_cause(read(log)) == errors[0], read(log)
    assert re.fullmatch(r"=== \S+: finished with status 1: " + re.escape(errors[0]),
                        read(log).rstrip().splitlines()[-1]), read(log)


def test_gpu_job_whose_torch_sees_no_gpu_stops_in_one_line_unless_the_cpu_is_asked_for(slurm, tmp_path):
    """Slurm grants GPUs; this torch sees none (the CPU build here plays a CPU-only torch, or a missing
    CUDA module): the job stops before training instead of training on the CPU for days."""
    assert not torch.cuda.is_available()
    train = [a for a in TRAIN if a not in CPU]
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=2"], [*train, "--out-dir", tmp_path / "run"])
    assert wait_job(job, log) == "FAILED", read(log)
    errors = [line for line in read(log).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Slurm granted 2 GPUs" in errors[0] and "sees none" in errors[0], read(log)
    assert "--device cpu" in errors[0] and "Training started" not in read(log)


def test_multinode_job_spans_both_nodes(slurm, tmp_path):
    out = tmp_path / "run"
    job, log = sbatch("multinode.sh", tmp_path, ["--nodes=2", "--gpus-per-node=2"],
                      [*TRAIN, "--out-dir", out])
    assert wait_job(job, log) == "COMPLETED", read(log)
    text = read(log)
    assert "torchrun: 2 nodes x 2 processes, rendezvous at node1:" in text
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 4 == 2 * summary["processes_per_node"]
    assert summary["nodes"] == 2 and summary["hosts"] == ["node1", "node2"]
    assert summary["finished"] is True
    # Each rank ran on its node's own address, and the ranks on node2 met the others at node1's
    # address (MASTER_ADDR, as it resolved there), not on a loopback: the nodes share none.
    ranks = read_json(out / "run.json")["ranks"]
    assert {(r["host"], r["address"]) for r in ranks} == set(NODE_ADDR.items())
    assert NODE_ADDR["node1"] != NODE_ADDR["node2"]
    assert {r["master_address"] for r in ranks if r["host"] == "node2"} == {NODE_ADDR["node1"]}


def test_srun_direct_without_torchrun(slurm, tmp_path):
    out = tmp_path / "run"
    job, log = sbatch("srun_direct.sh", tmp_path, ["--ntasks-per-node=2", "--gpus-per-task=1"],
                      [*TRAIN, "--out-dir", out])
    assert wait_job(job, log) == "COMPLETED", read(log)
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["processes_per_node"] == 2 and summary["finished"] is True
    # Without torchrun, RANK comes from SLURM_PROCID after start-up: still one log line, not one per task.
    assert read(log).count("Training started with 2 processes across 1 nodes.") == 1
    # A thread per CPU of the task (--cpus-per-task=1), not one per core of the node in each task.
    assert "=== threads per task: 1 (--cpus-per-task 1)" in read(log)


@pytest.fixture
def node1_fs(slurm, tmp_path):
    """A 16 MiB tmpfs mounted on node1, in its slurmd's mount namespace (each node has its own, as each
    host does); returns its path as the jobs see it, and the same directory as seen from here."""
    pid = subprocess.run(["pgrep", "-f", "slurmd -N node1"], capture_output=True, text=True).stdout.split()[0]
    path = tmp_path / "fs"
    path.mkdir()
    proc = subprocess.run(["nsenter", "-t", pid, "-m", "mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on node1: {proc.stderr.strip()}")
    yield path, Path(f"/proc/{pid}/root{path}")
    subprocess.run(["nsenter", "-t", pid, "-m", "umount", "-l", str(path)], capture_output=True)


def test_full_disk_under_srun_ends_every_task_in_one_line(tmp_path, node1_fs):
    """No torchrun to end the other tasks: the ranks agree on rank 0's failed write and leave together."""
    fs, seen = node1_fs
    out = fs / "run"
    train = [*TRAIN[:2], "--train-size", 1600, *TRAIN[4:8], "--epochs", 3, *TINY, *CPU, "--log-every", 0]
    job, log = sbatch("srun_direct.sh", tmp_path, ["--ntasks-per-node=2", "--gpus-per-task=1"],
                      [*train, "--out-dir", out])
    deadline = time.time() + 300
    while (not (seen / "run" / "metrics.jsonl").exists()
           or len(read_jsonl(seen / "run" / "metrics.jsonl")) < 1):
        assert time.time() < deadline and job_field(job, "JobState") in ("PENDING", "RUNNING"), read(log)
        time.sleep(0.1)
    with paused(training_pids(out, log)):
        fill(seen, 64 * 1024)  # during epoch 2: its checkpoint cannot be written
    filled = time.time()
    assert wait_job(job, log, timeout=300) == "FAILED", read(log)
    errors = [line for line in read(log).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, read(log)
    assert errors[0].startswith(f"error: no space left on device writing the checkpoint after epoch 2 in "
                                f"{out}; the last good checkpoint, {out}/checkpoint.pt (after epoch 1), is "
                                f"intact")
    assert read(log).rstrip().splitlines()[-1].endswith(f": {errors[0]}"), read(log)  # last, after srun's lines
    assert "timed out" not in read(log)
    # Both tasks left on their own with the agreed status (74: a failed write), none killed by srun or by a
    # collective's --timeout: an event, whatever the machine's speed (a wall-time bound failed on a busy one).
    # srun reports the tasks together ("tasks 0-1: Exited ...") or one line each, as they end.
    exited = set()
    for first, last in re.findall(r"node1: tasks? (\d+)(?:-(\d+))?: Exited with exit code 74", read(log)):
        exited.update(range(int(first), int(last or first) + 1))
    assert exited == {0, 1}, read(log)
    print(f"srun: the job ended {time.time() - filled:.1f} s after the disk filled (the rest of epoch 2 "
          f"included)")
    assert load_model_state(seen / "run")["progress"]["epoch"] == 1


# The runs Slurm's signals stop: 48 steps of 32 per epoch, dropout, and a loader worker per rank (Slurm
# signals the workers too); and what each must end with: the same training uninterrupted, here (the job's
# recipe, then these), on forked ranks and without the loader workers, which change nothing (measured: the
# same weights bit for bit; test_stop_signals.py resumes its stopped runs without them too), and save each rank
# a loader forkserver's start (20 s to 7 s for this run, alone on 2 cores).
SIGNAL_TRAIN = [*TRAIN[:2], "--train-size", 1536, *TRAIN[4:], "--dropout", 0.1, "--workers", 1,
                "--log-every", 5]
TRAINING = "step 5/"  # the ranks are in the training loop, where a stop signal is a checkpointed stop


@pytest.fixture(scope="module")
def signal_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("signal_reference") / "run"
    launch_forked([*job_recipe(), *SIGNAL_TRAIN, "--workers", 0, "--out-dir", out], nproc=2)
    return load_model_state(out)


def test_time_limit_warning_checkpoints_requeues_and_resumes_to_the_same_weights(slurm, tmp_path,
                                                                                  signal_reference):
    out = tmp_path / "run"
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=2"], [*SIGNAL_TRAIN, "--out-dir", out])
    wait_for_line(job, log, TRAINING)
    # The signal must land before training ends, however fast this machine is: the training is paused
    # until the job's shell has taken it.
    with paused(training_pids(out, log)):
        # Slurm's time-limit warning (--signal=B:USR1@180), sent by hand.
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
        wait_for_line(job, log, "signal received: asking the ranks to checkpoint and stop (USR1, "
                                "the time-limit warning")
    assert wait_job(job, log, timeout=900) == "COMPLETED", read(log)
    text = read(log)
    assert "Stop requested (stop file" in text and "exiting with status 75" in text
    assert f"requeueing job {job}" in text and "(restart 1)" in text
    # Said as a stop, not a crash: the ranks' 75, torchrun's own status, and that its FAILED lines are
    # expected.
    assert ("the run stopped on request, checkpointed (the ranks exit 75; the launcher reports 1, so its "
            "FAILED" in text)
    assert "Resumed from" in text and "Training completed successfully." in text
    assert not [f for f in os.listdir(ROOT) if f.startswith(".ddp-stop-")]  # the stop file is cleaned up
    assert_same_weights(out, signal_reference)


def assert_ended_with_a_checkpoint(job, log, out, state):
    """The job ended in `state` for good, not requeued, its ranks stopped on SIGTERM with a mid-epoch
    checkpoint, and its log says how to resume; nothing of the loader workers' death."""
    assert wait_job(job, log) == state, read(log)
    text = read(log)
    assert "signal received: asking the ranks to checkpoint and stop (TERM: scancel, the time limit" in text
    assert "Stop requested (SIGTERM) in epoch 1 after step" in text and "requeueing" not in text
    # the ranks' word, not a guess
    assert "the run stopped on request, checkpointed (the ranks exit 75" in text
    assert f"=== job {job} ends here" in text and "to resume, submit the same command again" in text
    assert "DataLoader worker" not in text and "killed by signal" not in text
    assert job_field(job, "Restarts") == "0" and "(restart 1)" not in text
    progress = load_model_state(out)["progress"]
    assert progress["epoch"] == 0 and 0 < progress["position"] < 1536, progress
    assert not [f for f in os.listdir(ROOT) if f.startswith(f".ddp-stop-{job}")]


def test_scancel_checkpoints_and_ends_the_job_and_the_same_command_resumes_to_the_same_weights(
        slurm, tmp_path, signal_reference):
    """scancel: SIGTERM to every process of the job (the batch shell, torchrun, the ranks, their loader
    workers), then SIGKILL after KillWait. The cancel is the user's word: the job ends, with a checkpoint to
    resume from."""
    out = tmp_path / "run"
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=2"], [*SIGNAL_TRAIN, "--out-dir", out])
    wait_for_line(job, log, TRAINING)
    with paused(training_pids(out, log)):  # lands before training ends; Slurm sends SIGCONT with its TERM
        subprocess.run(["scancel", job], check=True)
        wait_for(lambda: "signal received" in read(log), timeout=300,
                 what="the job's shell taking the signal")
    assert_ended_with_a_checkpoint(job, log, out, "CANCELLED")
    (again_dir := tmp_path / "again").mkdir()
    again, again_log = sbatch("multigpu.sh", again_dir, ["--gpus=2"], [*SIGNAL_TRAIN, "--out-dir", out])
    assert wait_job(again, again_log) == "COMPLETED", read(again_log)
    assert "Resumed from" in read(again_log) and "Training completed successfully." in read(again_log)
    assert_same_weights(out, signal_reference)


def test_a_job_that_reaches_its_time_limit_checkpoints_ends_and_the_same_command_resumes_to_the_same_weights(
        slurm, tmp_path, signal_reference):
    """srun_direct.sh with a one-minute limit and no warning signal (--signal=B:USR1@0): at the limit Slurm
    sends SIGTERM to every process (the batch shell, srun, the tasks, their workers), then SIGKILL after
    KillWait. The training is held (SIGSTOP) until then, so that the limit lands mid-epoch however fast the
    machine."""
    out = tmp_path / "run"
    limit = ["--ntasks-per-node=2", "--gpus-per-task=1", "--time=1", "--signal=B:USR1@0"]
    # the ranks are held longer than TINY's --timeout
    train = [*SIGNAL_TRAIN, "--timeout", 600, "--out-dir", out]
    # as torchrun sets it for the reference's ranks: the same sums, the same bits
    threads = {"OMP_NUM_THREADS": "1"}
    job, log = sbatch("srun_direct.sh", tmp_path, limit, train, env=threads)
    wait_for_line(job, log, TRAINING)
    with paused(training_pids(out, log)):
        # A minute, and up to Slurm's 30 s check of the limits; the job's state may already say it ends.
        wait_for(lambda: "signal received" in read(log), timeout=300, what="the time limit's signal")
    assert "DUE TO TIME LIMIT" in read(log)
    assert_ended_with_a_checkpoint(job, log, out, "TIMEOUT")
    (again_dir := tmp_path / "again").mkdir()
    # The same command, with room to finish: on a busy machine the rest of the run can take more than a
    # minute (it did), and the limit would end it again.
    roomy = [a for a in limit if a != "--time=1"]  # SMALL_NODE's 15 minutes
    again, again_log = sbatch("srun_direct.sh", again_dir, roomy, train, env=threads)
    assert wait_job(again, again_log) == "COMPLETED", read(again_log)
    assert "Resumed from" in read(again_log) and "Training completed successfully." in read(again_log)
    assert_same_weights(out, signal_reference)


@pytest.fixture
def node_disks(slurm, tmp_path):
    """mount(size): a tmpfs of `size` (or of sizes[node] for each node) mounted at one path on each node, in each
    slurmd's mount namespace: each node's own local disk, as each host has one. Returns the path (as the jobs see
    it) and each node's view of it from here."""
    mounted = []

    def mount(sizes):
        sizes = sizes if isinstance(sizes, dict) else dict.fromkeys(NODE_ADDR, sizes)
        path = tmp_path / ("local-" + "-".join(sizes.values()))
        path.mkdir()
        views = {}
        for node, size in sizes.items():
            pid = subprocess.run(["pgrep", "-f", f"slurmd -N {node}"], capture_output=True,
                                 text=True).stdout.split()[0]
            proc = subprocess.run(["nsenter", "-t", pid, "-m", "mount", "-t", "tmpfs", "-o", f"size={size}",
                                   "tmpfs", str(path)], capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs on {node}: {proc.stderr.strip()}")
            mounted.append((pid, path))
            views[node] = Path(f"/proc/{pid}/root{path}")
        return path, views
    yield mount
    for pid, path in mounted:
        subprocess.run(["nsenter", "-t", pid, "-m", "umount", "-l", str(path)], capture_output=True)


def cifar_tar(tmp_path) -> Path:
    """A tar.gz of a (generated) cifar-100-python folder, as a user would pack their data for STAGE_DATA."""
    write_cifar100(tmp_path / "shared", 320, 64, archive=False)
    archive = tmp_path / "cifar.tar.gz"
    subprocess.run(["tar", "-czf", archive, "-C", tmp_path / "shared", "cifar-100-python"], check=True)
    return archive


# What each rank of the image-folder job below opens and lists under the folders $READS_UNDER names, written to
# $READS_LOG.<rank>: "open <path>" for each file, "list <folder>" for each os.scandir (the audit hook sees the rank's
# own reads: no loader workers).
COUNTED_READS = '''
def load_data(cfg, env, train: bool = True):
    """The README's image-folder load_data, with each file opened and each folder listed written down."""
    import sys
    watched = tuple(os.environ["READS_UNDER"].split(os.pathsep))

    def count(event, args):
        if event in ("open", "os.scandir") and isinstance(args[0], str) and args[0].startswith(watched):
            with open(f"{os.environ['READS_LOG']}.{env.rank}", "a") as f:
                f.write(f"{'open' if event == 'open' else 'list'} {args[0]}\\n")
    sys.addaudithook(count)
    return readme_load_data(cfg, env, train)
'''


def image_folder_job(tmp_path, n_train: int, n_test: int, counted: bool = False, folder_itself: bool = False) -> tuple:
    """Real Fashion-MNIST PNG folders on "shared storage", their tar (of train/ and test/, or of the folder itself that
    holds them, `folder_itself`: shared/train/...), and a project whose train_ddp.py reads them with the README's
    image-folder load_data (COUNTED_READS' if `counted`), beside the project's jobs/ as a user's copy: (the folders,
    the tar, the job's environment: STAGE_DATA and the project)."""
    from test_adapt import adapted_script, readme_load_data, write_fashion_pngs
    shared = write_fashion_pngs(tmp_path / "shared", n_train, n_test)
    archive = tmp_path / "pngs.tar"
    subprocess.run(["tar", "-cf", archive, *(["-C", tmp_path, "shared"] if folder_itself else
                                             ["-C", shared, "train", "test"])], check=True)
    project, readme = tmp_path / "project", readme_load_data("image folders")
    if counted:
        readme = readme.replace("def load_data(", "def readme_load_data(") + "\n\n" + COUNTED_READS
    adapted_script(project, load_data=readme)
    (project / "jobs").symlink_to(os.path.join(ROOT, "jobs"))
    return shared, archive, {"STAGE_DATA": str(archive), "PROJECT_DIR": str(project), "SLURM_TMPDIR": "",
                             "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def test_an_image_folder_tar_is_staged_once_per_node_listed_once_read_only_there_and_removed_each_run(
        slurm, tmp_path, node_disks):
    """STAGE_DATA=a tar of real Fashion-MNIST PNG folders, packed as the folder itself (shared/train/...), on 2 nodes
    x 2 ranks, each node with a local disk of its own, trained with the README's image-folder reader and requeued by
    the time-limit warning. In each of the 2 runs: one extraction per node, used as the one folder it holds; rank 0
    lists each class folder once, the 3 others none; the ranks open every image in the staged copy and none on shared
    storage; at each run's end each node's copy is gone, said before the run's own last line, which ends the .out
    log, and no line of the cleanup step's (srun's, slurmstepd's) is left in the .err log."""
    shared, archive, env = image_folder_job(tmp_path, 640, 128, counted=True, folder_itself=True)
    local, views = node_disks("64m")
    out, reads, err = tmp_path / "run", tmp_path / "reads", tmp_path / "job.err"
    env.update(LOCAL_DATA_DIR=str(local), READS_LOG=str(reads), READS_UNDER=os.pathsep.join([str(shared), str(local)]))
    job, log = sbatch("multinode.sh", tmp_path, ["--nodes=2", "--gpus-per-node=2", f"--error={err}"],
                      [*TINY, *CPU, "--batch-size", 32, "--epochs", 2, "--loader", "torch", "--log-every", 1,
                       "--out-dir", out], env=env)
    wait_for_line(job, log, "step 2/")
    with paused(training_pids(out, log)):
        first_cleanup = cleanup_step(job)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
        wait_for_line(job, log, "signal received: asking the ranks to checkpoint and stop (USR1")
    wait_for_line(job, log, "Resumed from", timeout=600)
    with paused(training_pids(out, log)):  # the requeued run, its .err lines so far written
        second_run = len(read(err))
    assert wait_job(job, log, timeout=900) == "COMPLETED", read(log)
    text, staged_dir = read(log), f"{local}/ddp-data-{job}"
    data_dir = f"{staged_dir}/shared"
    assert "(restart 1)" in text and "Resumed from" in text and "Training completed successfully." in text
    staged = re.findall(r"^=== (node\d): staged \S+ in 768 files of (\S+) into (\S+) in [\d.]+ s; --data-dir is the "
                        rf"one folder at its top, {data_dir}, which holds: test/ train/$", text, re.M)
    assert sorted(node for node, _, _ in staged) == ["node1", "node1", "node2", "node2"], text  # per node, per run
    assert {(source, into) for _, source, into in staged} == {(str(archive), staged_dir)}
    removed = re.findall(rf"^=== (node\d): removed the staged copy {staged_dir}$", text, re.M)
    assert sorted(removed) == ["node1", "node1", "node2", "node2"], text
    assert all(not os.listdir(view) for view in views.values())
    assert read_json(out / "config.json")["data_dir"] == data_dir
    assert re.fullmatch(r"=== \S+: finished with status 0", text.splitlines()[-1]), text
    # The first run's training step ends as a stop on request does (its tasks exit non-zero, srun's
    # --kill-on-bad-exit cancels the rest: its lines expected), but not its cleanup step; the second ends cleanly.
    assert f"STEP {first_cleanup} " not in read(err)[:second_run], read(err)
    assert not re.search(r"Job step aborted|CANCELLED|STEP \d", read(err)[second_run:]), read(err)

    logged = {rank: open(f"{reads}.{rank}").read().splitlines() for rank in range(4)}
    class_folders = [f"{data_dir}/{split}/{d.name}" for split in ("train", "test")
                     for d in sorted((shared / split).iterdir())]
    assert sorted(line for line in logged[0] if line.startswith("list ") and "/class_" in line) == sorted(
        f"list {folder}" for folder in class_folders * 2)  # once per run
    assert not any(line.startswith("list ") for rank in (1, 2, 3) for line in logged[rank])
    opened = {line[5:] for lines in logged.values() for line in lines if line.startswith("open ")}
    images = {str(f) for f in shared.rglob("*.png")}
    assert {f.replace(data_dir, str(shared), 1) for f in opened if f.startswith(staged_dir)} == images
    assert not any(f.startswith(str(shared)) or f == str(archive) for f in opened)


@pytest.mark.parametrize("packing", ["folder", "tar", "gz", "bz2", "xz", "zst"])
def test_one_node_stages_a_folder_or_a_tar_of_any_compression_file_for_file(tmp_path, packing):
    """jobs/stage_node.sh, one node's part of STAGE_DATA, run as srun runs it (no Slurm needed): the copy holds every
    file as it was, and the line says how many, from where, into where, and the top level --data-dir then holds."""
    data = tmp_path / "data"
    for split, n in (("train", 3), ("test", 2)):
        for i in range(n):
            (data / split / f"class_{i}").mkdir(parents=True)
            (data / split / f"class_{i}" / f"{i}.png").write_bytes(os.urandom(1000 + i))
    source = data
    if packing != "folder":
        flag = {"tar": [], "gz": ["-z"], "bz2": ["-j"], "xz": ["-J"], "zst": ["--zstd"]}[packing]
        tool = {"gz": "gzip", "bz2": "bzip2", "xz": "xz", "zst": "zstd"}.get(packing)
        if tool and not shutil.which(tool):
            pytest.skip(f"no {tool} here")
        source = tmp_path / f"data.{packing}"
        subprocess.run(["tar", "-cf", source, *flag, "-C", data, "train", "test"], check=True)
    dest = tmp_path / "local" / "ddp-data-7"
    proc = subprocess.run(["bash", os.path.join(ROOT, "jobs", "stage_node.sh"), source, dest, "100",
                           tmp_path / "report"], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert re.fullmatch(rf"=== \S+: staged \S+ in 5 files of {source} into {dest} in [\d.]+ s; --data-dir holds: "
                        rf"test/ train/\n", proc.stdout), proc.stdout
    files = sorted(p.relative_to(data) for p in data.rglob("*.png"))
    assert sorted(p.relative_to(dest) for p in dest.rglob("*.png")) == files
    assert all((dest / f).read_bytes() == (data / f).read_bytes() for f in files)



def test_a_tar_of_the_folder_itself_is_staged_as_that_folder_and_the_line_names_the_slurm_node(tmp_path):
    """stage_node.sh as srun runs it, on a node whose Slurm name is not its hostname: a tar made of the folder itself
    (tar -cf digits.tar digits, train/ and test/ inside) is used as that folder (--data-dir one level down, as the
    batch script then asks for it); a tar whose one folder holds no train/ (cifar-100-python/) stays as it is; the
    line names the node as Slurm does (SLURMD_NODENAME)."""
    for split in ("train", "test"):
        (tmp_path / "digits" / split / "class_0").mkdir(parents=True)
        (tmp_path / "digits" / split / "class_0" / "0.png").write_bytes(b"png")
    (tmp_path / "cifar-100-python").mkdir()
    for name in ("train", "test", "meta"):
        (tmp_path / "cifar-100-python" / name).write_bytes(b"pickle")
    stage = os.path.join(ROOT, "jobs", "stage_node.sh")
    one_folder = "--data-dir is the one folder at its top, {dest}/digits, which holds: test/ train/"
    for folder, data_dir, holds in (("digits", "{dest}/digits", one_folder),
                                    ("cifar-100-python", "{dest}", "--data-dir holds: cifar-100-python/")):
        archive, dest = tmp_path / f"{folder}.tar", tmp_path / "local" / folder / "ddp-data-7"
        subprocess.run(["tar", "-cf", archive, "-C", tmp_path, folder], check=True)
        proc = subprocess.run(["bash", stage, archive, dest, "100", tmp_path / "report"], capture_output=True,
                              text=True, env={**os.environ, "SLURMD_NODENAME": "gpu-node-17"})
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
        assert re.fullmatch(rf"=== gpu-node-17: staged \S+ in \d files of {archive} into {dest} in [\d.]+ s; "
                            rf"{holds.format(dest=dest)}\n", proc.stdout), proc.stdout
        asked = subprocess.run(["bash", stage, "--data-dir", dest], capture_output=True, text=True, check=True)
        assert asked.stdout == data_dir.format(dest=dest) + "\n"

def test_scancel_while_training_on_staged_files_removes_the_copy_only_after_the_ranks_checkpointed(
        slurm, tmp_path, node_disks):
    """scancel signals every step at once, the staged copy's cleanup too; the rank reads on from the copy until its
    checkpoint (up to 10 steps on: the ranks' stop check), so the cleanup waits for it to leave: no file goes
    missing, and the copy is gone once the job has ended. The tar is of the folder itself: --data-dir is the folder
    inside the copy, which the cleanup waits for as well."""
    _, archive, env = image_folder_job(tmp_path, 640, 64, folder_itself=True)
    local, views = node_disks("64m")
    out = tmp_path / "run"
    job, log = sbatch("multigpu.sh", tmp_path, ["--gpus=1"],
                      [*TINY, *CPU, "--batch-size", 16, "--epochs", 1, "--loader", "torch", "--workers", 1,
                       "--log-every", 1, "--out-dir", out], env={**env, "LOCAL_DATA_DIR": str(local)})
    wait_for_line(job, log, "step 2/")
    with paused(training_pids(out, log)):  # Slurm sends SIGCONT with its TERM
        subprocess.run(["scancel", job], check=True)
        wait_for(lambda: "signal received" in read(log), timeout=300, what="the job's shell taking the signal")
    assert wait_job(job, log) == "CANCELLED", read(log)
    text = read(log)
    assert re.search(r"Stop requested \(SIGTERM\) in epoch 1 after step \d+", text), text
    assert not [line for line in text.splitlines() if line.startswith("error: ")], text  # no file went missing
    assert 0 < load_model_state(out)["progress"]["position"] < 640
    wait_for(lambda: not os.listdir(views["node1"]), timeout=60, what="the staged copy removed")


STAGED_TRAIN = [*TRAIN[2:], "--dataset", "cifar100"]  # the data: the staged archive's


def test_each_stage_data_refusal_ends_the_job_before_training_in_one_line_leaving_no_copy(
        slurm, tmp_path, node_disks):
    """Each refusal ends the job before training with one line, and leaves no copy on any node: one node's local
    disk with less free space than the archive (the other node's copy removed), an archive that does not extract
    (each staged on 2 nodes); no node-local directory, and STAGE_DATA beside --data-dir (refused by the batch
    script itself, in multigpu.sh and srun_direct.sh)."""
    archive = cifar_tar(tmp_path)
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(archive.read_bytes()[:archive.stat().st_size // 2])
    # node2's disk too small, node1's large enough: node1's copy is removed too
    (small, small_views), (large, views) = node_disks({"node1": "64m", "node2": "64k"}), node_disks("64m")
    assert archive.stat().st_size > 64 * 1024
    two_nodes = ("multinode.sh", ["--nodes=2", "--gpus-per-node=1"])
    for name, (script, request), env, args, says in (
            ("small", two_nodes, {"STAGE_DATA": str(archive), "LOCAL_DATA_DIR": str(small)}, [],
             rf"staging failed on node2: {small} has [\d.]+KiB free, but STAGE_DATA {archive} needs [\d.]+[KM]iB: "
             rf"ask for a node with more local disk \(#SBATCH --tmp=<size>, where the cluster grants it\), or unset "
             rf"STAGE_DATA to read the data where they are"),
            ("truncated", two_nodes, {"STAGE_DATA": str(truncated), "LOCAL_DATA_DIR": str(large)}, [],
             rf"staging failed on node\d: STAGE_DATA {truncated} does not extract \(.+\): a truncated or corrupt "
             rf"archive\? check it with tar -tf, and copy it again"),
            ("nowhere", ("multigpu.sh", ["--gpus=1"]), {"STAGE_DATA": str(archive)}, [],
             r"STAGE_DATA is set, but there is no node-local directory to stage into: this cluster sets no "
             r"SLURM_TMPDIR; set LOCAL_DATA_DIR to the nodes' local disk \(/tmp, /localscratch, ...\), or unset "
             r"STAGE_DATA"),
            ("both", ("srun_direct.sh", ["--ntasks-per-node=1", "--gpus-per-task=1"]),
             {"STAGE_DATA": str(archive), "LOCAL_DATA_DIR": str(large)}, ["--data-dir", tmp_path],
             r"STAGE_DATA and a data directory \(DATA_DIR, --data-dir\) are both given: the job trains on the staged "
             r"copy of STAGE_DATA; give one of them")):
        (tmp_path / name).mkdir()
        job, log = sbatch(script, tmp_path / name, request, [*STAGED_TRAIN, *args, "--out-dir", tmp_path / name],
                          env={"SLURM_TMPDIR": "", **env})  # no SLURM_TMPDIR from this host: LOCAL_DATA_DIR decides
        assert wait_job(job, log) == "FAILED", read(log)
        errors = [line for line in read(log).splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and re.fullmatch(f"error: {says}", errors[0]), (name, errors, read(log))
        assert "Training started" not in read(log)
    assert all(not os.listdir(view) for view in [*views.values(), *small_views.values()])  # every copy removed


def test_preflight_job_checks_both_nodes(slurm, tmp_path):
    job, log = sbatch("preflight.sh", tmp_path, ["--nodes=2", "--gpus-per-node=1"],
                      ["--dataset", "synthetic", "--out-dir", tmp_path / "out", "--device", "cpu"])
    assert wait_job(job, log) == "COMPLETED", read(log)
    text = read(log)
    assert "world size 2" in text and "all_reduce bus bandwidth: 1 MiB" in text
    assert {h for h in ("node1", "node2") if f" {h} " in text} == {"node1", "node2"}
    assert "preflight: all checks passed" in text
    # Its network check, before torchrun: node2 reached the rendezvous at node1's address.
    port = 20000 + int(job) % 20000
    assert f"network on node2: ok, rendezvous node1:{port} ({NODE_ADDR['node1']} from node2)" in text
    assert (f"network on node1: ok, rendezvous node1:{port} ({NODE_ADDR['node1']} from node1), reached by "
            f"the 1 other" in text)


# The two classic multi-node failures, each with a short --timeout: the job must end within it (plus
# the ranks' start-up), with the one-line message of the README's troubleshooting table, and the
# preflight job must name the cause as a failed check.
TIMEOUT = 20
FAIL_TRAIN = ["--dataset", "synthetic", "--train-size", 128, "--test-size", 32, "--batch-size", 16,
              "--epochs", 1, *CPU, *TINY[:-1], TIMEOUT]
PREFLIGHT = ["--dataset", "synthetic", "--device", "cpu", "--timeout", TIMEOUT]


def wait_failed(job, log):
    assert wait_job(job, log, timeout=300) == "FAILED", read(log)
    assert run_seconds(job) < 2 * TIMEOUT + 15, (f"job {job} took {run_seconds(job)} s with --timeout "
                                                 f"{TIMEOUT}")
    return read(log)


def test_interface_that_cannot_reach_the_other_node_fails_fast(slurm, tmp_path):
    # GLOO_SOCKET_IFNAME=lo (the gloo twin of NCCL_SOCKET_IFNAME): the rendezvous on node1's address
    # works, but each rank advertises 127.0.0.1, which the ranks on the other node cannot reach.
    env = {"GLOO_SOCKET_IFNAME": "lo"}
    train, train_log = sbatch("multinode.sh", tmp_path, ["--nodes=2", "--gpus-per-node=1"],
                              [*FAIL_TRAIN, "--out-dir", tmp_path / "run"], env=env)
    check, check_log = sbatch("preflight.sh", tmp_path, ["--nodes=2", "--gpus-per-node=1"],
                              [*PREFLIGHT, "--out-dir", tmp_path / "out"], env=env)
    text = wait_failed(train, train_log)
    assert "cannot connect to another rank at 127.0.0.1, a loopback address" in text
    assert "GLOO_SOCKET_IFNAME=lo names an interface the other nodes cannot reach" in text
    text = wait_failed(check, check_log)
    for node in NODE_ADDR:
        assert (f"FAILED: network on {node}: GLOO_SOCKET_IFNAME=lo is the loopback interface, which the "
                f"other nodes cannot reach") in text
        assert f"the interface that holds this node's address (eth0 {NODE_ADDR[node]})" in text
    assert "all checks passed" not in text


def test_master_address_that_does_not_answer_fails_within_the_timeout(slurm, tmp_path):
    # node2's own /etc/hosts maps node1 to an address where nothing answers on the rendezvous port
    # (a stale entry: node2's own), so node2's ranks never reach the master; node1's are fine.
    # jobs/srun_direct.sh: its ranks meet without torchrun, within --timeout.
    with open(NODE2_HOSTS) as f:
        hosts = f.read()
    stale = hosts.replace(f"{NODE_ADDR['node1']} node1 ", f"{NODE_ADDR['node2']} node1 ")
    assert stale != hosts
    try:
        with open(NODE2_HOSTS, "w") as f:  # in place: node2's slurmd sees this very file as /etc/hosts
            f.write(stale)
        train, train_log = sbatch("srun_direct.sh", tmp_path,
                                  ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-task=1"],
                                  [*FAIL_TRAIN, "--out-dir", tmp_path / "run"])
        check, check_log = sbatch("preflight.sh", tmp_path, ["--nodes=2", "--gpus-per-node=1"],
                                  [*PREFLIGHT, "--out-dir", tmp_path / "out"])
        train_text, check_text = wait_failed(train, train_log), wait_failed(check, check_log)
    finally:
        with open(NODE2_HOSTS, "w") as f:
            f.write(hosts)
    assert (f"timed out after {TIMEOUT} s in init_process_group waiting for all 2 ranks at node1:"
            in train_text)
    port = 20000 + int(check) % 20000
    assert (f"FAILED: network on node2: the rendezvous node1:{port} ({NODE_ADDR['node2']} from node2) did "
            f"not answer within {TIMEOUT} s") in check_text
    assert (f"FAILED: network on node1: 1 of 1 other node(s) did not reach the rendezvous node1:{port}"
            in check_text)
    assert "all checks passed" not in check_text


def test_scaling_job_benchmarks_each_size_with_each_comm_hook_and_plots(slurm, tmp_path):
    """jobs/scaling.sh with COMM_HOOKS="none fp16" on 2 nodes x 1 GPU: bench.py on 1 GPU (torchrun on one node) and
    on 2 (srun, a torchrun per node) with each hook, a JSON each, at a fixed per-GPU batch, then one plot."""
    # one thread per process: torchrun sets it for 2 ranks, not for the 1-GPU size
    env = {"PER_GPU_BATCH": "16", "SCALING_DIR": str(tmp_path / "results"), "OMP_NUM_THREADS": "1",
           "COMM_HOOKS": "none fp16"}
    job, log = sbatch("scaling.sh", tmp_path, ["--nodes=2", "--gpus-per-node=1"],
                      ["--", "--depth", 10, "--widen-factor", 1, "--steps", 3, "--warmup", 1,
                       "--device", "cpu", "--train-size", 1024], env=env)
    assert wait_job(job, log) == "COMPLETED", read(log)
    for suffix, hook in (("", "none"), ("-fp16", "fp16")):
        results = [read_json(tmp_path / "results" / f"{size}{suffix}.json") for size in ("1x1", "2x1")]
        assert [r["world_size"] for r in results] == [1, 2]
        assert [r["config"]["batch_size"] for r in results] == [16, 32]  # fixed per-GPU batch
        assert all(r["config"]["comm_hook"] == hook for r in results)
        # the flags after -- reach every size's bench.py
        assert all(r["ours"]["augment_epoch_images"] == 1024 for r in results)
    assert (tmp_path / "results" / "scaling.png").stat().st_size > 10_000


def test_job_scripts_pass_shellcheck():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = sorted(os.path.join(ROOT, "jobs", f) for f in os.listdir(os.path.join(ROOT, "jobs"))
                     if f.endswith(".sh"))
    proc = subprocess.run(["shellcheck", "-S", "warning", "-x", *scripts], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout
