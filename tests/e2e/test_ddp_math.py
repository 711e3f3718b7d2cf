"""The properties users care about, on CPU with several processes launched by torchrun."""
import json
import re

import pytest
import torch

from conftest import TINY, launch, load_model_state, read_json, read_jsonl, write_cifar100
from model import WideResNet


@pytest.mark.parametrize("world_size,workers,n", [(2, 2, 600), (3, 0, 601),
                                                  pytest.param(2, 0, 577, marks=pytest.mark.quick)])
def test_each_epoch_visits_every_sample_once_in_a_new_order(tmp_path, world_size, workers, n):
    """601 and 577 leave a short last step (with 2 ranks, 577 leaves rank 1 nothing in it)."""
    write_cifar100(str(tmp_path), n, 10, kind="index", archive=False)
    out = tmp_path / "record.json"
    launch([tmp_path, out, 32, 3, workers], nproc=world_size, script="tests/helpers/record_batches.py")
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
    launch([tmp_path / "one.pt", 64], nproc=1, script="tests/helpers/ddp_step.py")
    launch([tmp_path / "two.pt", 64], nproc=2, script="tests/helpers/ddp_step.py")
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
    out = tmp_path / "run"
    common = ["--data-dir", learnable_dir, "--out-dir", out, "--test-size", 301, *TINY]
    launch(["--train-size", 1000, "--epochs", 2, "--warmup-epochs", 0, "--batch-size", 64, "--base-lr", 0.4, *common])
    results = []
    for n in (1, 2, 3):
        proc = launch(["--evaluate", "--batch-size", 6, *common], nproc=n)
        assert proc.stdout.count("Validation Loss:") == 1
        results.append(read_json(out / "eval.json"))
        assert results[-1]["world_size"] == n
    first = results[0]
    assert first["val_count"] == 301 and 0.02 < first["val_acc"] < 1.0
    for r in results[1:]:
        assert r["val_count"] == first["val_count"]
        assert r["val_acc"] == first["val_acc"] and r["val_top5"] == first["val_top5"]
        assert r["val_loss"] == pytest.approx(first["val_loss"], rel=1e-6)


@pytest.mark.quick
def test_resume_is_exact(tmp_path, learnable_dir):
    common = ["--data-dir", learnable_dir, "--train-size", 480, "--test-size", 100, "--epochs", 2,
              "--batch-size", 64, "--base-lr", 0.4, "--dropout", 0.2, *TINY, "--workers", 1]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch([*common, "--out-dir", straight], nproc=2)
    first = launch([*common, "--out-dir", resumed, "--stop-after-epoch", 1], nproc=2)
    assert "Stopping after epoch 1" in first.stdout
    assert read_json(resumed / "summary.json")["finished"] is False
    second = launch([*common, "--out-dir", resumed], nproc=2)
    assert "Resumed from" in second.stdout and "Epoch 1/2" not in second.stdout and "Epoch 2/2" in second.stdout

    a, b = load_model_state(straight), load_model_state(resumed)
    assert a["progress"]["epoch"] == b["progress"]["epoch"] == 2
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    assert a["progress"]["position"] == b["progress"]["position"] == 0
    ma, mb = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [m["epoch"] for m in mb] == [1, 2]
    timing = {"epoch_time_s", "images_per_s"}
    for x, y in zip(ma, mb):
        assert {k: v for k, v in x.items() if k not in timing} == {k: v for k, v in y.items() if k not in timing}
    summary = read_json(resumed / "summary.json")
    assert summary["finished"] is True and summary["epochs_completed"] == 2


@pytest.mark.parametrize("world_size", [1, 2])
def test_it_learns_and_reports_like_the_seed(tmp_path, learnable_dir, world_size):
    out = tmp_path / "run"
    proc = launch(["--data-dir", learnable_dir, "--out-dir", out, "--epochs", 4, "--batch-size", 64,
                   "--base-lr", 0.4, "--target-accuracy", 1.0, *TINY], nproc=world_size)
    log = proc.stdout
    # The seed's lines, once per epoch, not once per rank.
    for epoch in range(1, 5):
        assert len(re.findall(rf"^Epoch {epoch}/4 completed in \d+\.\d{{3}} seconds$", log, re.M)) == 1
    assert len(re.findall(r"^Validation Loss: \d+\.\d{4}, Validation Accuracy: 0\.\d{4}$", log, re.M)) == 4
    assert len(re.findall(r"^Epoch Throughput: \d+\.\d{3} images/second$", log, re.M)) == 4
    assert f"Training started with {world_size} processes across 1 nodes." in log
    assert "\nTraining Summary:\n" in log and log.count("Training completed successfully.") == 1
    assert f"Total GPUs used: {world_size}" in log
    assert f"Global batch 64 = {world_size} ranks x {64 // world_size}" in log

    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["val_count"] == 500 for m in metrics)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == world_size and summary["nodes"] == 1 and summary["gpus_per_node"] == world_size
    assert summary["epochs_completed"] == 4 and summary["stopped_early"] is False
    assert summary["final_val_acc"] == metrics[-1]["val_acc"] >= 0.5, "chance is 0.01"
    assert summary["best_val_acc"] == max(m["val_acc"] for m in metrics)
    assert read_json(out / "config.json")["lr"] == pytest.approx(0.4 * 64 / 512)


def test_early_stopping_stops_every_rank_at_the_same_epoch(tmp_path):
    out = tmp_path / "run"
    proc = launch(["--dataset", "synthetic", "--train-size", 128, "--test-size", 50, "--batch-size", 32,
                   "--epochs", 6, "--target-accuracy", 0.0, "--patience", 2, "--out-dir", out, *TINY], nproc=2)
    assert proc.stdout.count("Target accuracy reached. Early stopping after epoch 2.") == 1
    summary = read_json(out / "summary.json")
    assert summary["stopped_early"] is True and summary["epochs_completed"] == 2 and summary["finished"] is True
    # Resuming a finished run trains nothing more.
    again = launch(["--dataset", "synthetic", "--train-size", 128, "--test-size", 50, "--batch-size", 32,
                    "--epochs", 6, "--target-accuracy", 0.0, "--patience", 2, "--out-dir", out, *TINY], nproc=2)
    assert "Epoch 3/6" not in again.stdout and read_json(out / "summary.json")["epochs_completed"] == 2


def test_gpu_loader_trains_exactly_like_the_torch_loader(tmp_path):
    common = ["--dataset", "synthetic", "--train-size", 256, "--test-size", 50, "--batch-size", 32, "--epochs", 1,
              "--dropout", 0.1, *TINY]
    launch([*common, "--out-dir", tmp_path / "torch", "--loader", "torch", "--workers", 1], nproc=2)
    launch([*common, "--out-dir", tmp_path / "gpu", "--loader", "gpu"], nproc=2)  # device-resident, here on CPU
    a, b = load_model_state(tmp_path / "torch"), load_model_state(tmp_path / "gpu")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_compiled_ddp_run_saves_a_checkpoint_the_plain_model_loads(tmp_path):
    out = tmp_path / "run"
    # 200 images in batches of 64: a smaller last batch, in training and in evaluation.
    common = ["--dataset", "synthetic", "--train-size", 200, "--test-size", 50, "--batch-size", 64, "--epochs", 1,
              "--out-dir", out, *TINY]
    trained = launch([*common, "--compile"], nproc=2)
    assert "Training completed successfully." in trained.stdout
    state = load_model_state(out)["model"]
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state)  # unwrapped from compile and DDP
    WideResNet(10, 1, 100).load_state_dict(state)
    evaluated = launch([*common, "--evaluate"], nproc=1)  # no compile, another world size
    acc = float(re.search(r"Validation Accuracy: ([\d.]+)", evaluated.stdout).group(1))
    # The same weights; compiled and eager kernels may round differently, enough to flip one near-tie.
    assert acc == pytest.approx(read_jsonl(out / "metrics.jsonl")[-1]["val_acc"], abs=1 / 50 + 1e-9)
