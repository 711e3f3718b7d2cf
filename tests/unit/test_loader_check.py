"""bench.py --loader-check's verdict and fixes (tools/loader_check.py), from given figures: the e2e test
(e2e/test_tools.py) runs the check itself, whose figures no test can choose."""
import pytest
import torch

from machinery.errors import UserError
from machinery.launch import DistEnv, cpus_per_rank, default_workers
from tools.loader_check import KEEPS_UP_WAIT, file_system, judge, name_fixes, read_rate, say_verdict


def test_a_loader_with_workers_keeps_up_when_its_slowest_rank_reads_a_batch_within_a_step():
    # 64 images a step of 0.1 s: 640 img/s consumed per rank
    fast = judge(read_per_rank=[2000, 700], step_s=0.1, per_rank_batch=64, overlapped=True)
    assert fast["keeps_up"] and fast["wait_share"] == 0 and fast["ratio"] == pytest.approx(700 / 640)
    # the slowest rank decides: 320 img/s, a batch in 0.2 s, so each step waits 0.1 s of its 0.2
    slow = judge(read_per_rank=[2000, 320], step_s=0.1, per_rank_batch=64, overlapped=True)
    assert not slow["keeps_up"] and slow["wait_share"] == pytest.approx(0.5) and slow["ratio"] == pytest.approx(0.5)


def test_a_loader_that_reads_within_the_step_adds_its_time_to_every_step():
    # --workers 0 or the device loader: reading 64 at 6400 img/s adds 0.01 s to a 0.1 s step
    serial = judge(read_per_rank=[6400, 6400], step_s=0.1, per_rank_batch=64, overlapped=False)
    assert serial["wait_share"] == pytest.approx(0.01 / 0.11) and not serial["keeps_up"]
    assert judge(read_per_rank=[64_000], step_s=0.1, per_rank_batch=64, overlapped=False)["wait_share"] < KEEPS_UP_WAIT


def test_the_fixes_fit_the_run_s_loader_data_and_file_system():
    files = dict(device_loader=False, in_memory=False, data_dir="/scratch/imgs")
    few = name_fixes(workers=2, cpus=8, fs="lustre", **files)
    assert few[0] == "more --workers (2 now; each rank here has 8 CPUs)"
    assert any(f.startswith("the data on each node's local disk (STAGE_DATA") and "/scratch/imgs is on lustre" in f
               for f in few)
    assert few[-1].startswith("load_data returning ImageData with --loader gpu")
    local = name_fixes(workers=8, cpus=8, fs="ext4", **files)
    assert local[0].startswith("more CPUs per rank") and not any("STAGE_DATA" in f for f in local)
    in_memory = name_fixes(workers=2, cpus=8, fs="nfs", device_loader=False, in_memory=True, data_dir="d")
    assert in_memory[1].startswith("--loader gpu") and not any("STAGE_DATA" in f for f in in_memory)
    assert name_fixes(workers=0, cpus=4, fs="ext4", device_loader=True, in_memory=True, data_dir="d") == [
        "--loader torch with --workers up to 4 (DataLoader workers make the batches beside the step; the device "
        "loader makes them within it, one image at a time for a transform other than the default crop and flip)"]


def test_the_verdict_says_the_share_of_the_step_spent_waiting_and_the_fixes_only_when_it_falls_short():
    slow = judge(read_per_rank=[320], step_s=0.1, per_rank_batch=64, overlapped=True)
    assert say_verdict(slow, ["more --workers", "STAGE_DATA"]) == (
        "loader check: it falls short: the slowest rank's loader delivers 0.50x what its step consumes, so each "
        "step would wait for data 50% of its time; the fixes: more --workers; STAGE_DATA")
    fast = judge(read_per_rank=[1280], step_s=0.1, per_rank_batch=64, overlapped=True)
    assert say_verdict(fast, ["more --workers"]) == ("loader check: it keeps up: the slowest rank's loader delivers "
                                                     "2.00x what its step consumes")


def test_cpus_per_rank_shares_torchrun_s_task_among_its_ranks_and_gives_an_srun_task_its_own(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")  # torchrun: 2 ranks on this node share the task's 4 CPUs
    assert cpus_per_rank(DistEnv(local_world_size=2)) == 2 and cpus_per_rank(DistEnv(local_world_size=8)) == 0
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # srun: one task, with its own CPUs, per rank
    assert cpus_per_rank(DistEnv(local_world_size=2)) == 4
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)))
    assert default_workers(DistEnv(local_world_size=2)) == 8  # --workers -1: at most 8


def test_file_system_names_the_mount_that_holds_the_path():
    assert file_system("/proc/self/status") == "proc"
    assert file_system("/") not in ("proc", "unknown")


class Batches:
    """A loader of `n` batches of 4 images, as the training loader yields them."""

    class batch_sampler:
        @staticmethod
        def set_epoch(epoch):
            pass

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for _ in range(self.n):
            yield torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.long)


def test_read_rate_times_the_batches_after_the_warm_up_and_refuses_an_epoch_the_warm_up_takes_whole():
    cpu = torch.device("cpu")
    assert read_rate(Batches(10), cpu, warmup=2, batches=5)["images"] == 20
    assert read_rate(Batches(4), cpu, warmup=2, batches=5)["images"] == 8  # the epoch's end first
    assert read_rate(Batches(10), cpu, warmup=0, batches=3)["shape"] == (3, 8, 8)
    with pytest.raises(UserError, match="an epoch holds 2 batches per rank, all taken by --warmup"):
        read_rate(Batches(2), cpu, warmup=2, batches=5)
