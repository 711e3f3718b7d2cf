"""DDP computes what one process computes: every training sample exactly once per epoch in a new order
on any world size (short last step included), a DDP step equal to single-process math, evaluation
exact on any world size (a rank with an empty test shard included), and the device-resident loader
training exactly like the DataLoader."""
import json

import pytest
import torch

from model import WideResNet
from support import (CKPT_RUN, SCRIPTS, TINY, launch_forked, load_model_state, read_json, read_jsonl,
                     run_in_process, write_cifar100)

TINY_SYNTH = ["--dataset", "synthetic", *TINY, "--device", "cpu"]


@pytest.mark.parametrize("world_size,workers,n", [(2, 2, 600), (3, 0, 601),
                                                  pytest.param(2, 0, 577, marks=pytest.mark.quick)])
def test_each_epoch_visits_every_sample_once_in_a_new_order(tmp_path, world_size, workers, n):
    """601 and 577 leave a short last step (with 2 ranks, 577 leaves rank 1 nothing in it)."""
    write_cifar100(str(tmp_path), n, 10, kind="index", archive=False)
    out = tmp_path / "record.json"
    launch_forked([tmp_path, out, 32, 3, workers], nproc=world_size, script=f"{SCRIPTS}/record_batches.py")
    record = json.loads(out.read_text())
    orders = []
    for epoch in ("1", "2", "3"):
        shards = record[epoch]
        assert len(shards) == world_size
        assert len({s["steps"] for s in shards}) == 1  # every rank takes the same number of steps
        visited = sorted(i for s in shards for i in s["ids"])
        assert visited == list(range(n)), f"epoch {epoch}: not every sample exactly once"
        orders.append([s["ids"] for s in shards])
    assert orders[0] != orders[1] != orders[2] and orders[0] != orders[2]


@pytest.mark.quick
def test_ddp_step_matches_single_process_math(tmp_path):
    launch_forked([tmp_path / "one.pt", 64], nproc=1, script=f"{SCRIPTS}/ddp_step.py")
    launch_forked([tmp_path / "two.pt", 64], nproc=2, script=f"{SCRIPTS}/ddp_step.py")
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    torch.manual_seed(0)
    init = WideResNet(10, 1).state_dict()
    moved = max((one[k].float() - init[k].float()).abs().max().item() for k in one)
    assert moved > 1e-2, "the step must change the weights for the comparison to mean anything"
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-6, rtol=1e-5), k


@pytest.mark.quick
def test_evaluation_is_exact_for_any_world_size(tmp_path, learnable_dir):
    """301 test images scored by the training run's last evaluation (1 process, batches of 64), then by
    --evaluate on 2 and 3 ranks in batches of 6 (uneven shards): each image once, the same counts."""
    out = tmp_path / "run"
    common = ["--data-dir", learnable_dir, "--out-dir", out, "--test-size", 301, *TINY]
    run_in_process(["--train-size", 1000, "--epochs", 2, "--warmup-epochs", 0, "--batch-size", 64,
            "--base-lr", 0.4, *common], check=True)
    first = read_jsonl(out / "metrics.jsonl")[-1]
    assert first["val_count"] == 301 and 0.02 < first["val_acc"] < 1.0
    for n in (2, 3):
        proc = launch_forked(["--evaluate", "--batch-size", 6, *common], nproc=n)
        assert proc.stdout.count("Validation Loss:") == 1
        r = read_json(out / "eval.json")
        assert r["world_size"] == n and r["val_count"] == first["val_count"]
        assert r["val_acc"] == first["val_acc"] and r["val_top5"] == first["val_top5"]
        assert r["val_loss"] == pytest.approx(first["val_loss"], rel=1e-6)


def test_empty_test_shard_neither_hangs_nor_miscounts_and_evaluate_needs_only_the_out_dir_or_test_size(
        tmp_path):
    out = tmp_path / "run"
    # 3 ranks, 2 test images: rank 2 scores nothing. A DDP forward in evaluation would wait for it forever.
    run = [*TINY_SYNTH, "--train-size", 60, "--test-size", 2, "--batch-size", 6, "--epochs", 1,
           "--timeout", 60]
    proc = launch_forked([*run, "--out-dir", out], nproc=3, timeout=300)
    assert read_jsonl(out / "metrics.jsonl")[0]["val_count"] == 2
    # Nothing but --out-dir: the model (WRN-10-1, not the default 16-8) and the data (synthetic, not
    # CIFAR-100) come from the checkpoint; its batch 6 need not divide by the 4 ranks to evaluate.
    ev = launch_forked(["--evaluate", "--out-dir", out, "--timeout", 60], nproc=4, timeout=300)
    lines = [ln for ln in ev.stdout.splitlines() if ln.strip()]
    assert lines[0] == (f"Evaluating {out}/checkpoint.pt (WRN-10-1 with 100 classes, 1 of 1 epochs trained) "
                        f"on 2 test images with 4 processes")
    assert lines[1].startswith("Validation Loss:") and lines[2].startswith("Validation Top-5 Accuracy:")
    assert len(lines) == 3, ev.stdout  # no training lines
    result = read_json(out / "eval.json")
    assert result["val_count"] == 2 and result["epoch"] == 1 and result["world_size"] == 4
    assert result["val_acc"] == read_jsonl(out / "metrics.jsonl")[0]["val_acc"]
    assert "Validation Accuracy: " in proc.stdout
    # --test-size chooses what --evaluate scores (a longer share of the test set, say); training may not
    # change it.
    run_in_process(["--evaluate", "--out-dir", out, "--test-size", 5, "--workers", 0], check=True)
    assert read_json(out / "eval.json")["val_count"] == 5
    refused = run_in_process([*run, "--epochs", 2, "--out-dir", out, "--test-size", 5])
    assert (refused.returncode != 0
            and "--test-size 5 differs from the 2 of the checkpoint" in refused.stdout + refused.stderr)
    assert "which trained on other data: use another --out-dir" in refused.stderr


def test_the_device_loader_stopped_mid_epoch_resumes_to_its_uninterrupted_weights(tmp_path,
                                                                                  uninterrupted_device_loader):
    """CKPT_RUN with the data device-resident (here on the CPU; the default crop and flip batched, drawn from
    its hash): stopped at step 4 of epoch 1 and resumed, it ends with the weights of its uninterrupted run."""
    run = [*CKPT_RUN, "--loader", "gpu"]
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    stop_file.touch()  # seen at the first check, CKPT_RUN's checkpoint at step 4
    stopped = launch_forked([*run, "--out-dir", out], nproc=2, env={"DDP_STOP_FILE": str(stop_file)}, check=False)
    assert "in epoch 1 after step 4" in stopped.stdout, stopped.stdout + stopped.stderr
    stop_file.unlink()
    launch_forked([*run, "--out-dir", out], nproc=2)
    got, want = load_model_state(out), uninterrupted_device_loader
    assert got["config"]["draws"] == "the device loader's crop and flip, from a hash"
    for k, value in want["model"].items():
        assert torch.equal(got["model"][k], value), k