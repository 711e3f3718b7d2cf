"""The modern recipe's options through the real entry point, on 2 CPU ranks: each option keeps what sets this
reference apart (a mid-epoch stop and resume ends bit-identical to the uninterrupted run; W ranks x A
micro-steps train as W x A ranks), and each behaviour does what it says: the weight EMA is updated every step,
scored, saved and what --evaluate scores; clipping bounds the update and reports the norm of the unscaled
gradients under fp16; the validation split is held out, selects best.pt and leaves the test set to report;
--init-from starts from a file's weights (another head afresh, another layer refused); a resume that changes
the recipe is refused. (The pieces in-process: tests/unit/test_modern_options.py.)"""
import pytest
import torch

from support import (TIMING_METRICS, TINY, assert_close_models, assert_one_line, launch_forked,
                     load_model_state, read_json, read_jsonl, run_in_process)

# 640 samples / 32 = 20 steps; a stop file present from the start stops every rank at the first check
# (step 10).
RUN = ["--dataset", "synthetic", "--train-size", 640, "--test-size", 64, "--batch-size", 32, "--epochs", 1,
       "--base-lr", 0.1, "--reference-batch-size", 128, *TINY, "--device", "cpu"]
# Each group's runs: 2 ranks x 2 micro-steps of 16 (test_accumulation.py's run, one epoch: 5 steps of 64 and
# one of 45), stopped at step 3 and resumed, against the same uninterrupted, and against 1 rank x 4
# micro-steps.
ACCUM = ["--dataset", "synthetic", "--train-size", 365, "--test-size", 50, "--batch-size", 64, "--epochs", 1,
         "--micro-batch", 16, "--base-lr", 0.1, "--warmup-epochs", 0.5, *TINY, "--device", "cpu"]

# Every option of the modern recipe, in two groups that train together (one launch per group and question, not
# per option): an option whose state a resume lost, or that trained otherwise on 1 x 4, changes its group's
# weights. Mixup and cutmix are in different groups, so that each runs alone (together they take turns).
OPTIONS = {
    "ema-clip-mixup-nwd-tta-val": ["--model-ema", "--model-ema-decay", 0.9, "--clip-grad-norm", 0.3,
                                   "--mixup-alpha", 0.4, "--norm-weight-decay", 0, "--tta", "--val-size", 64],
    "erase-ta-cutmix-init": ["--random-erase", 0.5, "--auto-augment", "ta_wide", "--cutmix-alpha", 1.0,
                             "--init-from", "WEIGHTS"],  # replaced by a state_dict the test writes
}


def options(name, tmp_path):
    flags = list(OPTIONS[name])
    if "WEIGHTS" in flags:
        torch.manual_seed(7)
        from model import WideResNet
        torch.save(WideResNet(10, 1, num_classes=100, in_channels=3).state_dict(), tmp_path / "weights.pt")
        flags[flags.index("WEIGHTS")] = tmp_path / "weights.pt"
    return flags


def assert_same_state(a, b):
    """Two checkpoints hold the same model (and weight EMA) bit for bit, at the same place."""
    assert (a["progress"]["position"] == b["progress"]["position"]
            and a["progress"]["epoch"] == b["progress"]["epoch"])
    for part in ("model", "model_ema"):
        assert (part in a) == (part in b)
        for k, v in a.get(part, {}).items():
            assert torch.equal(v, b[part][k]), (part, k)


def without_timings(metrics):
    return [{k: v for k, v in m.items() if k not in TIMING_METRICS} for m in metrics]


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """two_by_two(name): the out-dir of the uninterrupted 2 ranks x 2 micro-steps run with that option, and
    its flags; each once per module (both tests below compare with it)."""
    base, done = tmp_path_factory.mktemp("modern"), {}

    def run(name):
        if name not in done:
            flags = [*ACCUM, *options(name, base)]
            launch_forked([*flags, "--out-dir", base / name], nproc=2)
            done[name] = (base / name, flags)
        return done[name]
    return run


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """RUN for 2 epochs on 2 ranks with the weight EMA (decay 0.9), and its output: scored, saved, evaluated,
    and the file --init-from starts from."""
    out = tmp_path_factory.mktemp("ema") / "run"
    proc = launch_forked([*RUN, "--epochs", 2, "--model-ema", "--model-ema-decay", 0.9, "--out-dir", out],
                         nproc=2)
    return out, proc.stdout


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The same run without the EMA (nor any other option): the original script's records."""
    out = tmp_path_factory.mktemp("plain") / "run"
    launch_forked([*RUN, "--epochs", 2, "--out-dir", out], nproc=2)
    return out


@pytest.mark.parametrize("name", OPTIONS)
def test_each_option_stopped_mid_epoch_and_resumed_ends_bit_identical(name, two_by_two, tmp_path):
    reference, flags = two_by_two(name)
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    stop_file.touch()  # seen at the first check: --checkpoint-every 3 makes step 3 one
    first = launch_forked([*flags, "--checkpoint-every", 3, "--out-dir", out], nproc=2,
                          env={"DDP_STOP_FILE": str(stop_file)}, check=False)
    assert first.returncode != 0 and "in epoch 1 after step 3" in first.stdout, first.stdout + first.stderr
    assert load_model_state(out)["progress"]["position"] == 192
    stop_file.unlink()
    second = launch_forked([*flags, "--out-dir", out], nproc=2)
    assert "Resumed from" in second.stdout and "Initialised from" not in second.stdout
    assert_same_state(load_model_state(out), load_model_state(reference))
    assert (without_timings(read_jsonl(out / "metrics.jsonl"))
            == without_timings(read_jsonl(reference / "metrics.jsonl")))


@pytest.mark.parametrize("name", OPTIONS)
def test_each_option_trains_the_same_on_2_ranks_x_2_micro_steps_as_on_1_x_4(name, two_by_two, tmp_path):
    reference, flags = two_by_two(name)
    run_in_process([*flags, "--out-dir", tmp_path / "w1"], check=True)
    a, b = load_model_state(reference), load_model_state(tmp_path / "w1")
    assert_close_models(a, b)
    if "model_ema" in a:
        assert_close_models({"model": a["model_ema"]}, {"model": b["model_ema"]})
    m2, m1 = read_jsonl(reference / "metrics.jsonl"), read_jsonl(tmp_path / "w1" / "metrics.jsonl")
    assert m2[0]["train_samples"] == m1[0]["train_samples"]
    assert m2[0]["train_loss"] == pytest.approx(m1[0]["train_loss"], rel=1e-4)
    assert m2[0]["val_loss"] == pytest.approx(m1[0]["val_loss"], rel=1e-4)


def test_weight_ema_is_updated_every_step_scored_saved_and_what_evaluate_scores(ema_run, plain_run):
    out, stdout = ema_run
    assert stdout.count("(scores of the weight EMA, --model-ema)") == 2
    ckpt = load_model_state(out)
    assert int(ckpt["model_ema"]["n_averaged"]) == 40  # 20 steps x 2 epochs, on every rank alike
    ema = {k.removeprefix("module."): v for k, v in ckpt["model_ema"].items() if k != "n_averaged"}
    assert sorted(ema) == sorted(ckpt["model"])  # the weights and the BatchNorm buffers
    assert not torch.equal(ema["fc.weight"], ckpt["model"]["fc.weight"])  # an average, not the weights
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["scored"] for m in metrics] == ["model_ema"] * 2
    launch_forked(["--evaluate", "--out-dir", out], nproc=2)
    scored = read_json(out / "eval.json")
    # the EMA, as the epoch scored it
    assert scored["val_loss"] == pytest.approx(metrics[-1]["val_loss"], rel=1e-9)
    # The EMA does not change training: the same run without it trains the same weights, and they score
    # otherwise.
    assert torch.equal(load_model_state(plain_run)["model"]["fc.weight"], ckpt["model"]["fc.weight"])
    assert (read_jsonl(plain_run / "metrics.jsonl")[-1]["val_loss"]
            != pytest.approx(metrics[-1]["val_loss"]))


def test_clipping_bounds_the_update_and_fp16_reports_the_unscaled_norm(tmp_path):
    # 2 steps of 32 (fp16 on a CPU is slow: no native kernels)
    plain = [*RUN, "--train-size", 64, "--weight-decay", 0, "--momentum", 0, "--warmup-epochs", 0,
             "--lr-schedule", "constant"]
    run_in_process([*plain, "--clip-grad-norm", 1e-6, "--out-dir", tmp_path / "tiny"], check=True)
    # a bound no gradient reaches: the updates unclipped, and the norm reported
    run_in_process([*plain, "--clip-grad-norm", 1e9, "--out-dir", tmp_path / "free"], check=True)
    torch.manual_seed(0)  # build_training's initial weights
    from model import WideResNet
    start = WideResNet(10, 1, num_classes=100, in_channels=3).state_dict()
    lr, steps = 0.1 * 32 / 128, 2
    for name, tensor in load_model_state(tmp_path / "tiny")["model"].items():
        if name.endswith(("weight", "bias")) and "running" not in name:
            # each step moves <= lr x 1e-6
            assert (tensor - start[name]).abs().max() <= lr * steps * 1e-6 * 1.01, name
    moved = max((t - start[n]).abs().max() for n, t in load_model_state(tmp_path / "free")["model"].items()
                if n.endswith(("weight", "bias")))
    assert moved > 1e-3
    run_in_process([*plain, "--clip-grad-norm", 1e9, "--amp", "fp16", "--out-dir", tmp_path / "fp16"],
                   check=True)
    norms = {amp: read_jsonl(tmp_path / folder / "metrics.jsonl")[0] for amp, folder in (("off", "free"),
                                                                                         ("fp16", "fp16"))}
    assert norms["off"]["grad_norm"] > 0 and norms["off"]["nonfinite_grad_steps"] == 0
    # fp16's gradients are scaled by 2^16 or so until unscaled: the same norm only if clipping unscales first.
    assert norms["fp16"]["grad_norm"] == pytest.approx(norms["off"]["grad_norm"], rel=0.2)


def test_validation_split_is_held_out_selects_best_pt_and_the_test_set_reports(tmp_path):
    out = tmp_path / "run"
    proc = run_in_process([*RUN, "--epochs", 3, "--val-size", 64, "--out-dir", out], check=True)  # 1 process
    assert "Data: synthetic (learnable, of CIFAR-100's shape): 576 training and 64 test images" in proc.stdout
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["train_samples"] for m in metrics] == [576] * 3  # the 64 held out are never trained on
    assert all(m["val_count"] == 64 and m["test_count"] == 64 for m in metrics)
    assert proc.stdout.count("Test Loss: ") == 3
    accs = [m["val_acc"] for m in metrics]
    best = accs.index(max(accs))  # the first of equals
    best_ckpt = torch.load(out / "best.pt", map_location="cpu", weights_only=True)
    assert best_ckpt["progress"]["epoch"] == best + 1
    summary = read_json(out / "summary.json")
    assert summary["final_test_acc"] == metrics[-1]["test_acc"]
    assert (summary["best_val_epoch"] == best + 1
            and summary["test_acc_at_best_val"] == metrics[best]["test_acc"])
    assert summary["best_val_acc"] == max(accs)
    # Early stopping follows the validation split: a target it reaches at epoch 1 ends the run there.
    early = run_in_process([*RUN, "--epochs", 3, "--val-size", 64, "--target-accuracy", 0.0, "--patience", 1,
                    "--out-dir", tmp_path / "early"], check=True)
    assert "Early stopping after epoch 1" in early.stdout


def test_without_val_size_the_test_set_is_the_original_script_s_validation(plain_run):
    metrics, summary = read_jsonl(plain_run / "metrics.jsonl"), read_json(plain_run / "summary.json")
    assert "test_acc" not in metrics[0] and metrics[0]["val_count"] == 64
    assert summary["final_test_acc"] == summary["final_val_acc"] == metrics[-1]["val_acc"]
    assert not (plain_run / "best.pt").exists()


def test_init_from_starts_from_the_file_s_weights_and_refuses_another_model(tmp_path, ema_run):
    first, _ = ema_run
    # training that leaves the weights where they start
    still = [*RUN, "--base-lr", 1e-12, "--weight-decay", 0]
    second = run_in_process([*still, "--init-from", first / "checkpoint.pt",
                             "--out-dir", tmp_path / "second"], check=True)
    assert f"Initialised from the weight EMA in {first}/checkpoint.pt" in second.stdout
    ema = {k.removeprefix("module."): v for k, v in load_model_state(first)["model_ema"].items()
           if k != "n_averaged"}
    for name, tensor in load_model_state(tmp_path / "second")["model"].items():
        if name.endswith(("weight", "bias")) and "running" not in name:
            assert torch.allclose(tensor, ema[name], atol=1e-9), name
    torch.save({"conv1.weight": torch.zeros(16, 1, 3, 3)}, tmp_path / "gray.pt")
    refused = run_in_process([*RUN, "--init-from", tmp_path / "gray.pt", "--out-dir", tmp_path / "third"])
    assert refused.returncode != 0
    assert_one_line(refused.stderr,
                    "--init-from", "gray.pt: layer conv1.weight is (16, 1, 3, 3), the model's (16, 3, 3, 3)")
    assert not (tmp_path / "third" / "checkpoint.pt").exists()


def test_a_resume_that_changes_the_recipe_is_refused_and_one_that_only_scores_otherwise_goes_on(tmp_path):
    out = tmp_path / "run"
    run_in_process([*RUN, "--epochs", 2, "--stop-after-epoch", 1, "--mixup-alpha", 0.2, "--out-dir", out],
                   check=True)
    before = load_model_state(out)
    for change, says in ((["--mixup-alpha", 0.4], "--mixup-alpha 0.4 differs from the 0.2 of the checkpoint"),
                         (["--mixup-alpha", 0.2, "--model-ema"],
                          "--model-ema True differs from the False of the checkpoint"),
                         (["--mixup-alpha", 0.2, "--val-size", 64], "--val-size 64 differs from the 0")):
        proc = run_in_process([*RUN, "--epochs", 2, *change, "--out-dir", out])
        assert proc.returncode != 0
        assert_one_line(proc.stderr, says)
        assert_same_state(load_model_state(out), before)  # the checkpoint kept
    resumed = run_in_process([*RUN, "--epochs", 2, "--mixup-alpha", 0.2, "--tta", "--out-dir", out],
                             check=True)
    assert ("resumed with changes: --tta False -> True" not in resumed.stdout
            and "Epoch 2/2 completed" in resumed.stdout)
