"""The CUDA paths, on a machine with GPUs: `pytest tests/gpu` on a GPU node checks what CI (no GPU) cannot: NCCL,
bf16 and fp16 autocast, channels_last, fused SGD, the on-GPU data path (the default's batched crop and flip, and a
pipeline of per-image ops), --compile under DDP, CUDA RNG states in checkpoints, CUDA-event step splits, peak memory
and --profile's kernels, the weight EMA, clipping under fp16's scaler, --tta, --val-size's best.pt, stop signals with
loader workers (a forkserver, pinned memory), recompute_bn_stats under NCCL, the loader check, data staged on the node
(jobs/stage_node.sh), and the benchmark's CUDA-event timing and MFU. Everything else in the suite runs the same code
on CPU with gloo.

Without CUDA the tests skip; GPU_TESTS_ON_CPU=1 runs them as a stand-in on CPU processes (gloo): the same runs and
the assertions that do not need CUDA, so that a test's own plumbing is checked where there is no GPU
(bench-results/gpu_checklist.py --dry-run runs a few that way in CI). test_gpu_options.py and test_gpu_tools.py hold the
rest; gpu_common.py what they share."""
import re

import pytest
import torch

import dataset_utils as du
from gpu_common import CUDA, DEVICE, NPROC, RUN, SKIP_WITHOUT_A_GPU, UNIT, launch
from support import build_loaders, load_model_state, read_json, read_jsonl

pytestmark = SKIP_WITHOUT_A_GPU


def device_loaders(data, device, rank, augment=None):
    """The device loader's (train, test) on `device`, rank `rank` of 2, the training one at epoch 3 from sample 64."""
    common = dict(batch_size=64, rank=rank, world_size=2, accum_steps=1, eval_batch=32, seed=5, workers=0,
                  pin_memory=False, augment=augment)
    train, test = build_loaders(data, data, **common, device=torch.device(device))
    train.batch_sampler.set_epoch(3)
    train.batch_sampler.start_at(64)
    return train, test


def test_the_device_loader_on_the_gpu_matches_itself_on_the_cpu_bit_for_bit():
    """The default's batched crop and flip: the same batches on the GPU as on the CPU."""
    g = torch.Generator().manual_seed(0)
    data = du.ImageData(torch.randint(0, 256, (300, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(300))
    for rank in range(2):
        (cpu_train, cpu_test), (gpu_train, gpu_test) = (device_loaders(data, d, rank) for d in ("cpu", DEVICE))
        pairs = list(zip(cpu_train, gpu_train)) + list(zip(cpu_test, gpu_test))
        assert len(pairs) == len(cpu_train) + len(cpu_test)
        for (xa, ya), (xb, yb) in pairs:
            assert xb.device.type == DEVICE and torch.equal(xa, xb.cpu()) and torch.equal(ya, yb.cpu())


def test_a_per_image_pipeline_on_the_device_loader_draws_as_it_does_on_the_cpu():
    """--loader gpu with another pipeline than the default (TrivialAugment, random erasing): per image, torchvision's
    ops on the device's tensors, each image's draws from its key. The same draws on the GPU as on the CPU give the
    same images up to the rounding of the ops' arithmetic; other draws would differ by tens of levels."""
    g = torch.Generator().manual_seed(1)
    data = du.ImageData(torch.randint(0, 256, (200, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(200))
    augment = dict(auto_augment="ta_wide", random_erase=0.5)
    (cpu_train, _), (gpu_train, _) = (device_loaders(data, d, 0, augment) for d in ("cpu", DEVICE))
    batches = list(zip(cpu_train, gpu_train))
    assert len(batches) == len(cpu_train) > 0
    for (xa, ya), (xb, yb) in batches:
        assert xb.device.type == DEVICE and xb.dtype == torch.uint8 and torch.equal(ya, yb.cpu())
        diff = (xa.int() - xb.cpu().int()).abs()
        assert diff.float().mean() < 0.5 and (diff > 2).float().mean() < 0.01, diff.float().mean()


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_training_on_gpus_resumes_and_finishes(tmp_path, amp):
    out = tmp_path / "run"
    amp = amp if CUDA else "off"
    first = launch([*RUN, "--amp", amp, "--out-dir", out, "--stop-after-epoch", 1], nproc=NPROC)
    assert f"Using {NPROC} {UNIT} per node." in first.stdout
    ckpt = load_model_state(out)
    assert len(ckpt["rng_cuda"] or []) == (NPROC if CUDA else 0) and ckpt["config"]["device_type"] == DEVICE
    assert ckpt["config"]["amp_dtype"] == {"bf16": "bfloat16", "fp16": "float16", "off": None}[amp]
    second = launch([*RUN, "--amp", amp, "--out-dir", out], nproc=NPROC)
    assert "Resumed from" in second.stdout and "Training completed successfully." in second.stdout
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [1, 2] and all(m["val_count"] == 256 for m in metrics)
    assert all(0 < m["train_loss"] < 10 for m in metrics)
    run = read_json(out / "run.json")
    assert bool(run["versions"]["nccl"]) == CUDA and len({r["device"] for r in run["ranks"]}) == 1


def test_each_epoch_reports_every_rank_s_gpu_time_split_and_peak_memory(tmp_path):
    """On CUDA the split is of the GPU's time (CUDA events read at the epoch's end; DDP's all-reduce timed by
    the step log's comm hook), and the log and metrics.jsonl hold each rank's peak memory; --profile leaves a trace with
    the GPU's kernels."""
    out = tmp_path / "run"
    proc = launch([*RUN, "--epochs", 1, "--out-dir", out, "--profile"], nproc=NPROC)
    row = read_jsonl(out / "metrics.jsonl")[0]
    assert len(row["rank_times"]) == NPROC
    for r in row["rank_times"]:
        phases = [r[f"{p}_s"] for p in ("data", "compute", "sync", "optimizer", "other")]
        assert all(p >= 0 for p in phases) and r["sync_s"] > 0
        # GPU time, from CUDA events: the steps add up to the epoch's wall time less what the host did alone.
        assert r["step_s"] * r["steps"] == pytest.approx(row["epoch_time_s"], rel=0.1)
    trace = (out / "profile" / "rank0.json").read_text()
    if CUDA:
        assert re.search(r"Peak GPU memory: [0-9.]+ GiB \(rank \d on ", proc.stdout)
        assert row["peak_memory_gib"] > 0 and all(r["peak_memory_gib"] > 0 for r in row["rank_times"])
        assert '"cat": "kernel"' in trace or '"cat":"kernel"' in trace
    else:
        assert '"cat": "cpu_op"' in trace or '"cat":"cpu_op"' in trace


def test_compile_under_ddp_trains_and_saves_plain_keys(tmp_path):
    out = tmp_path / "run"
    proc = launch([*RUN, "--epochs", 1, "--compile", "--out-dir", out], nproc=NPROC)
    assert "Training completed successfully." in proc.stdout
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in load_model_state(out)["model"])
    # Grads whose strides differ from DDP's bucket views cost a copy every step.
    assert "Grad strides do not match bucket view strides" not in proc.stderr
