"""The modern recipe's options on the GPU (tests/gpu/test_gpu.py's docstring: a GPU, or the CPU stand-in): one run with
them all, fp16, and what each must show."""
import pytest
import torch

from gpu_common import AMP, DEVICE, NPROC, RUN, SKIP_WITHOUT_A_GPU, launch
from support import load_model_state, read_json, read_jsonl

# one worker for this file's tests under pytest-xdist's --dist loadgroup (the GPU checklist): they share one run
pytestmark = [SKIP_WITHOUT_A_GPU, pytest.mark.xdist_group("options")]


OPTIONS = ["--model-ema", "--model-ema-decay", 0.9, "--clip-grad-norm", 1e9, "--tta", "--val-size", 256,
           "--auto-augment", "ta_wide", "--random-erase", 0.25, "--mixup-alpha", 0.2, "--epochs", 2]


@pytest.fixture(scope="module")
def options_run(tmp_path_factory):
    """One run with the modern recipe's options at once, fp16 (its grad scaler), on the device loader: 2 epochs;
    and the same without the options but clipping, in full precision, for the gradient norm."""
    root = tmp_path_factory.mktemp("options")
    proc = launch([*RUN, *OPTIONS, *AMP, "--out-dir", root / "options"], nproc=NPROC)
    launch([*RUN, "--epochs", 1, "--clip-grad-norm", 1e9, "--amp", "off", "--out-dir", root / "fp32"], nproc=NPROC)
    return root, proc


def test_weight_ema_on_the_gpu_is_updated_every_step_scored_and_saved(options_run):
    root, proc = options_run
    ckpt, metrics = load_model_state(root / "options"), read_jsonl(root / "options" / "metrics.jsonl")
    steps = sum(-(-m["train_samples"] // 128) for m in metrics)  # every step of both epochs
    assert int(ckpt["model_ema"]["n_averaged"]) == steps and all(m["scored"] == "model_ema" for m in metrics)
    ema = {k.removeprefix("module."): v for k, v in ckpt["model_ema"].items() if k != "n_averaged"}
    assert sorted(ema) == sorted(ckpt["model"])  # the weights and the BatchNorm buffers
    assert not torch.equal(ema["fc.weight"], ckpt["model"]["fc.weight"])  # an average, not the weights
    assert proc.stdout.count("(scores of the weight EMA, --model-ema)") == 2


def test_clipping_under_fp16_s_scaler_reports_the_unscaled_norm(options_run):
    """fp16's gradients are scaled by 2^16 or so until unscaled: the norm clipping sees (and metrics.jsonl reports)
    is the full-precision run's only if the scaler unscales first."""
    root, _ = options_run
    fp16, fp32 = (read_jsonl(root / run / "metrics.jsonl")[0] for run in ("options", "fp32"))
    assert fp16["nonfinite_grad_steps"] <= 2 and 0 < fp16["grad_norm"] < 100 * fp32["grad_norm"]
    assert fp32["grad_norm"] > 0


def test_tta_and_the_validation_split_pick_best_pt_and_report_the_test_set(options_run):
    root, proc = options_run
    out = root / "options"
    metrics, summary = read_jsonl(out / "metrics.jsonl"), read_json(out / "summary.json")
    assert all(m["val_count"] == 256 and m["test_count"] == 256 for m in metrics)
    assert [m["train_samples"] for m in metrics] == [2048 - 256] * 2  # the held-out samples never trained
    best = max(metrics, key=lambda m: m["val_acc"])
    assert torch.load(out / "best.pt", map_location="cpu", weights_only=True)["progress"]["epoch"] == best["epoch"]
    assert summary["test_acc_at_best_val"] == best["test_acc"] and "Test accuracy: final" in proc.stdout
    # --tta averages each image's logits with its mirror's: --evaluate without it scores otherwise.
    losses = []
    for flag in ("--tta", "--no-tta"):
        launch(["--evaluate", "--out-dir", out, "--device", DEVICE, "--workers", 0, flag], nproc=NPROC)
        losses.append(read_json(out / "eval.json")["val_loss"])
    # the epoch's own score again (to the rounding of another process's kernels), and another without the mirror
    assert losses[0] == pytest.approx(metrics[-1]["test_loss"], rel=1e-3), (losses, metrics[-1]["test_loss"])
    assert losses[0] != losses[1], losses
