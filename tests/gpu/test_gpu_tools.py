"""Loader workers, stop signals, BatchNorm statistics, the loader check, staged data, the benchmark and SyncBatchNorm on
the GPU (tests/gpu/test_gpu.py's docstring: a GPU, or the CPU stand-in)."""
import os
import re
import signal
import subprocess
import tarfile

import pytest
import torch

import dataset_utils as du
from gpu_common import CUDA, DEVICE, GPUS, NPROC, RUN, SKIP_WITHOUT_A_GPU, launch
from support import (ROOT, SCRIPTS, TINY, build_loaders, every_process, load_model_state, paused, read_json,
                     read_jsonl, start, text, wait_for, write_cifar100)

pytestmark = SKIP_WITHOUT_A_GPU


def test_the_torch_loader_on_a_gpu_pins_memory_in_forkserver_workers():
    """--loader torch on CUDA: DataLoader workers forked by the rank's forkserver, batches in pinned memory (the
    copy to the GPU then overlaps the step)."""
    g = torch.Generator().manual_seed(2)
    data = du.ImageData(torch.randint(0, 256, (256, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(256))
    train, _ = build_loaders(data, data, batch_size=64, rank=0, world_size=1, accum_steps=1, eval_batch=64, seed=0,
                             workers=2, pin_memory=CUDA)
    loader = train.loader  # the DataLoader inside the loader that skips unreadable samples
    assert loader.multiprocessing_context.get_start_method() == "forkserver" and loader.pin_memory == CUDA
    train.batch_sampler.set_epoch(1)
    images, labels = next(iter(train))
    assert images.shape == (64, 3, 32, 32) and images.is_pinned() == CUDA


def test_a_stop_signal_with_loader_workers_on_gpus_checkpoints_and_resumes_to_the_end(tmp_path):
    """SIGTERM to every process (ranks, torchrun, loader workers with pinned memory) mid-epoch: a checkpoint, exit
    to be resumed, no worker's death; the resumed run finishes the epochs."""
    out = tmp_path / "run"
    run = [*RUN, "--train-size", 4096, "--loader", "torch", "--workers", 2, "--out-dir", out]  # its --workers win
    proc, log = start(run, nproc=NPROC)
    wait_for(lambda: "Epoch 1/2 completed" in text(log) or proc.poll() is not None, what="epoch 1's end")
    pids = every_process(proc)
    with paused(pids):  # lands in epoch 2 however fast the machine is
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=120) in (1, 75), text(log)
    output = text(log)
    assert "Stop requested (SIGTERM) in epoch 2 after step" in output, output
    assert "DataLoader worker" not in output and "killed by signal" not in output, output
    assert load_model_state(out)["progress"]["epoch"] == 1
    resumed = launch(run, nproc=NPROC)
    assert "Resumed from" in resumed.stdout and "Training completed successfully." in resumed.stdout


# ------------------------------------------------------------------ BatchNorm statistics, the loader check, staging

def test_recomputed_bn_stats_under_nccl_are_those_of_all_samples_on_every_rank(tmp_path):
    """tools.bn_stats.recompute_bn_stats (SWA's, or a model's statistics made afresh) on the GPUs: each rank scores
    its uneven shard, and every rank ends with the statistics of all samples, as one process computes them."""
    launch([tmp_path, 37, 5, DEVICE], nproc=NPROC, script=f"{SCRIPTS}/bn_stats.py")
    (tmp_path / "one").mkdir()
    launch([tmp_path / "one", 37, 5, DEVICE], nproc=1, script=f"{SCRIPTS}/bn_stats.py")
    whole = torch.load(tmp_path / "one" / "rank0.pt")
    for rank in range(NPROC):
        stats = torch.load(tmp_path / f"rank{rank}.pt")
        for key in ("mean", "var"):
            assert stats[key].device.type == "cpu"
            torch.testing.assert_close(stats[key], whole[key], rtol=1e-4, atol=1e-5)


def test_the_loader_check_on_gpus_says_whether_the_loader_keeps_up(tmp_path):
    path = tmp_path / "check.json"
    proc = launch(["--loader-check", "--dataset", "synthetic", "--train-size", 4096, "--batch-size", 128,
                   "--device", DEVICE, *TINY, "--steps", 5, "--warmup", 2, "--json", path], nproc=NPROC,
                  script="bench.py")
    assert re.search(rf"the step consumes \d+ img/s per rank, \d+ img/s in all \({NPROC} {DEVICE} process",
                     proc.stdout), proc.stdout
    check = read_json(path)["loader_check"]
    assert len(check["images_per_s_per_rank"]) == NPROC and check["step_s"] > 0
    assert isinstance(check["keeps_up"], bool)


def test_data_staged_on_the_node_trains_on_the_gpus(tmp_path):
    """STAGE_DATA's part on a node (jobs/stage_node.sh): a tar of the data extracted to the node's local disk, then
    the GPUs train from that copy."""
    source = tmp_path / "source"
    write_cifar100(source, 512, 128, archive=False)
    archive = tmp_path / "cifar.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(source / "cifar-100-python", arcname="cifar-100-python")
    staged = tmp_path / "local" / "data"
    subprocess.run(["bash", os.path.join(ROOT, "jobs", "stage_node.sh"), archive, staged, "100",
                    tmp_path / "report"], check=True, capture_output=True, text=True)
    assert (staged / "cifar-100-python" / "train").is_file()
    run = [*RUN, "--dataset", "cifar100", "--data-dir", staged, "--train-size", 0, "--test-size", 0,
           "--loader", "torch", "--workers", 2, "--epochs", 1, "--out-dir", tmp_path / "run"]
    proc = launch(run, nproc=NPROC)
    assert "Training completed successfully." in proc.stdout
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["train_samples"] == 512


def test_benchmark_on_the_gpu_reports_mfu_and_the_ratio_to_the_original(tmp_path):
    path = tmp_path / "bench.json"
    proc = launch(["--depth", 10, "--widen-factor", 2, "--batch-size", 256 * NPROC, "--steps", 10, "--warmup", 3,
                   "--workers", 2, "--compare-original", "--device", DEVICE, "--json", path], nproc=NPROC,
                  script="bench.py")
    assert re.search(rf"^ours: \d+ img/s, \d+ img/s per {DEVICE}", proc.stdout, re.M)
    result = read_json(path)
    ours = result["ours"]
    assert ours["augment_epoch_s"] > 0 and (ours["peak_memory_gib"] > 0 if CUDA else True)
    assert result["original"]["images_per_s"] > 0
    assert result["speedup_vs_original"] == pytest.approx(ours["images_per_s"] / result["original"]["images_per_s"])
    if CUDA and "unknown peak" not in ours["peak_note"]:
        assert 0 < ours["mfu"] < 1
    if CUDA:
        assert result["device"] == torch.cuda.get_device_name(0)


def run_sync_bn_step(tmp_path, nproc, sync_bn, batch=64):
    out = tmp_path / f"{nproc}x-sync{int(sync_bn)}.pt"
    launch([out, batch, int(sync_bn)], nproc=nproc, script=f"{SCRIPTS}/sync_bn_step.py")
    return torch.load(out)


def max_rel_diff(a, b):
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)).item()
               for k in b if b[k].is_floating_point())


@pytest.mark.skipif(not CUDA, reason="SyncBatchNorm runs on CUDA only: no CPU stand-in")
def test_sync_bn_two_ranks_of_half_the_batch_equal_one_rank_of_the_whole(tmp_path):
    """BatchNorm in train mode: with --sync-bn's SyncBatchNorm, 2 ranks x B/2 normalise over the same
    B samples as 1 rank x B, so the updated parameters and running statistics agree; without it they
    differ (the control that shows the comparison can fail). On a one-GPU machine the 2 ranks share
    the GPU over gloo (see the helper)."""
    whole = run_sync_bn_step(tmp_path, 1, sync_bn=False)
    synced = run_sync_bn_step(tmp_path, 2, sync_bn=True)
    unsynced = run_sync_bn_step(tmp_path, 2, sync_bn=False)
    assert synced.keys() == whole.keys()
    # One float32 step at LR 0.5: SyncBatchNorm computes the variance another way (per-rank mean and
    # invstd, combined), which an H100 put at 8e-4 relative; per-shard BN puts it at 1e-1 and more.
    assert max_rel_diff(synced, whole) < 5e-3
    assert max_rel_diff(unsynced, whole) > 5e-2


@pytest.mark.skipif(not CUDA or GPUS < 2, reason="the entry point runs one rank per GPU: needs 2 GPUs")
def test_sync_bn_through_the_entry_point_matches_one_rank(tmp_path):
    """The same through train_ddp.py: an epoch on 2 GPUs with --sync-bn ends where 1 GPU ends."""
    run = [*RUN, "--epochs", 1, "--amp", "off", "--dropout", 0]
    launch([*run, "--out-dir", tmp_path / "one"], nproc=1)
    proc = launch([*run, "--sync-bn", "--out-dir", tmp_path / "two"], nproc=2)
    assert "Training completed successfully." in proc.stdout
    one, two = load_model_state(tmp_path / "one")["model"], load_model_state(tmp_path / "two")["model"]
    # 16 steps with cuDNN's tf32 convolutions (PyTorch's default): looser than the one-step test above.
    assert max_rel_diff(two, one) < 2e-2
