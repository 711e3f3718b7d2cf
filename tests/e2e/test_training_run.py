"""Whole training runs: a tiny WRN learns (far above chance) on 2 ranks and prints the original script's
lines once, not once per rank; the README's one-minute CPU run, one plain process, learns and prints the
same lines; early stopping stops every rank at the same epoch; and a compiled DDP run saves a checkpoint
the plain model loads."""
import json
import os
import re

import pytest

from model import WideResNet
from support import ROOT, TINY, launch, launch_forked, load_model_state, read_json, read_jsonl, run_in_process


def assert_original_script_lines(log, epochs, world_size):
    """The original script's lines, once per epoch, not once per rank; its summary, with the unit said as it
    is on CPU (GPUs on CUDA); after each epoch but the last, the whole run's ETA, once."""
    for epoch in range(1, epochs + 1):
        assert len(re.findall(rf"^Epoch {epoch}/{epochs} completed in \d+\.\d{{3}} seconds$", log, re.M)) == 1
    validation = r"^Validation Loss: \d+\.\d{4}, Validation Accuracy: 0\.\d{4}$"
    assert len(re.findall(validation, log, re.M)) == epochs
    assert len(re.findall(r"^Epoch Throughput: \d+\.\d{3} images/second$", log, re.M)) == epochs
    assert (f"Training started with {world_size} processes across 1 nodes.\n"
            f"Using {world_size} CPU processes per node.\n" in log)
    assert "\nTraining Summary:\n" in log and log.count("Training completed successfully.") == 1
    summary_lines = log.split("\nTraining Summary:\n", 1)[1].splitlines()
    assert re.fullmatch(r"Total training time: \d+\.\d{3} seconds", summary_lines[0])
    assert re.fullmatch(r"Throughput: \d+\.\d{3} images/second", summary_lines[1])
    assert summary_lines[2:6] == ["Number of nodes: 1", f"Number of CPU processes per node: {world_size}",
                                  f"Total CPU processes used: {world_size}",
                                  "Training completed successfully."]
    assert "GPUs" not in log
    assert re.findall(rf"^Run: (\d) of {epochs} epochs done; about \d+ (?:s|min|h \d+ min) left \(ends about "
                      r"\d\d:\d\d\) at this session's pace$", log, re.M) == [str(e) for e in range(1, epochs)]


def assert_summary_of_a_finished_run(out, epochs, world_size):
    """metrics.jsonl has a row per epoch; summary.json names the processes and the result, final and best."""
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == list(range(1, epochs + 1))
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    summary = read_json(out / "summary.json")
    assert (summary["world_size"] == world_size and summary["nodes"] == 1
            and summary["processes_per_node"] == world_size)
    assert summary["epochs_completed"] == epochs and summary["stopped_early"] is False
    assert summary["final_val_acc"] == metrics[-1]["val_acc"] >= 0.5, "chance is 0.01"
    assert summary["best_val_acc"] == max(m["val_acc"] for m in metrics)
    return metrics


def test_it_learns_and_reports_like_the_original_script(tmp_path, learnable_dir):
    """On 2 ranks: the lines once, not once per rank. (On 1 process: the one-minute CPU run below.)"""
    out = tmp_path / "run"
    proc = launch(["--data-dir", learnable_dir, "--out-dir", out, "--epochs", 4, "--batch-size", 64,
                   "--base-lr", 0.4, "--target-accuracy", 1.0, *TINY], nproc=2, fast_exit=False)
    assert_original_script_lines(proc.stdout, epochs=4, world_size=2)
    assert "Global batch 64 = 2 ranks x 32" in proc.stdout
    metrics = assert_summary_of_a_finished_run(out, epochs=4, world_size=2)
    assert all(m["val_count"] == 500 for m in metrics)
    assert read_json(out / "config.json")["lr"] == pytest.approx(0.4 * 64 / 512)


def test_readme_one_minute_cpu_run_shows_learning(tmp_path):
    """The README's first run on a laptop, the cpu-try preset, in one plain process: its synthetic classes can
    be learned, so it ends far above chance (1%), at 50% top-1 or more; the original script's lines as on 2
    ranks; config.json records the preset and every value."""
    with open(os.path.join(ROOT, "README.md")) as f:
        command = next(line for line in f
                       if line.startswith(".venv/bin/python train_ddp.py --recipe cpu-try"))
    args = command.split("#")[0].split()[2:]
    assert args == ["--recipe", "cpu-try"], command  # the first command stays short
    # Its time says on what it was measured (cores, idle, the machine, the date) and what a busy machine does.
    with open(os.path.join(ROOT, "README.md")) as f:
        said = " ".join(f.read().split("**1. On a CPU**", 1)[1].split("```", 1)[0].split())
    assert re.search(r"took \d+ s .* on 2 idle cores of an? .+ \(torch [\d.]+, \d{4}-\d\d-\d\d\), and \d+ s on "
                     r"the same 2 cores while .* busy", said), said
    out = tmp_path / "cpu-try"
    proc = launch([*args, "--out-dir", out, "--log-every", 0], torchrun=False, fast_exit=False)
    accuracies = [float(a) for a in re.findall(r"Validation Accuracy: ([\d.]+)", proc.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] >= 0.5 and accuracies[0] < accuracies[-1], proc.stdout
    assert_original_script_lines(proc.stdout, epochs=3, world_size=1)
    assert "Global batch 128 = 1 ranks x 128" in proc.stdout
    metrics = assert_summary_of_a_finished_run(out, epochs=3, world_size=1)
    assert all(m["val_count"] == 1000 for m in metrics)
    config = read_json(out / "config.json")
    assert (config["recipe"] == "cpu-try"
            and (config["depth"], config["widen_factor"], config["epochs"]) == (10, 2, 3))
    assert config["out_dir"] == str(out) and config["lr"] == 0.1 and config["eval_batch"] == 128


def test_early_stopping_stops_every_rank_at_the_same_epoch(tmp_path):
    out = tmp_path / "run"
    run = ["--dataset", "synthetic", "--train-size", 128, "--test-size", 50, "--batch-size", 32, "--epochs", 6,
           "--target-accuracy", 0.0, "--patience", 2, "--out-dir", out, *TINY]
    proc = launch_forked(run, nproc=2)
    assert proc.stdout.count("Target accuracy reached. Early stopping after epoch 2.") == 1
    summary = read_json(out / "summary.json")
    assert (summary["stopped_early"] is True and summary["epochs_completed"] == 2
            and summary["finished"] is True)
    # Resuming a finished run trains nothing more (nothing to run on several ranks: in this process).
    again = run_in_process(run, check=True)
    assert "Epoch 3/6" not in again.stdout and read_json(out / "summary.json")["epochs_completed"] == 2
    # A run that stopped early, then died before its summary (a requeue after a kill): it trains no more either.
    os.remove(out / "summary.json")
    requeued = run_in_process(run, check=True)
    assert "Epoch 3/6" not in requeued.stdout and "Early stopping after epoch 2" in requeued.stdout
    summary = read_json(out / "summary.json")
    assert summary["stopped_early"] is True and summary["epochs_completed"] == 2


EARLY_STOPPING_LINE = re.compile(r"^Early stopping is on: the run ends once (\d+) epochs? in a row reach accuracy "
                                 r"([\d.]+) on (.*); --patience 0 trains all (\d+) epochs$", re.M)


@pytest.mark.parametrize("recipe", ["wrn-paper", "modern"])
def test_a_preset_that_follows_a_published_schedule_trains_every_epoch(tmp_path, recipe):
    """A target any model reaches: the paper's presets still train the epochs asked for, and say nothing of
    early stopping; the default run says at start that it is on, which split decides and how to turn it off."""
    run = ["--recipe", recipe, "--dataset", "synthetic", "--train-size", 64, "--test-size", 32, "--batch-size",
           32, "--epochs", 3, "--warmup-epochs", 0, "--target-accuracy", 0.0, "--log-every", 0, *TINY]
    full = run_in_process([*run, "--out-dir", tmp_path / "preset"], check=True)
    assert "Early stopping" not in full.stdout and "Epoch 3/3 completed" in full.stdout
    assert read_json(tmp_path / "preset" / "summary.json")["stopped_early"] is False
    # The same flags without the preset: the original script's early stopping, said once at start.
    default = run_in_process([*run[2:], "--out-dir", tmp_path / "default"], check=True)
    said = EARLY_STOPPING_LINE.findall(default.stdout)
    assert len(said) == 1 and said[0][:2] == ("2", "0") and said[0][3] == "3", default.stdout
    assert said[0][2].startswith("the test set (no --val-size") and "Early stopping after epoch 2." in default.stdout
    assert default.stdout.index("Early stopping is on") < default.stdout.index("Epoch 1/3")


def test_patience_0_turns_early_stopping_off_and_a_validation_split_is_named_as_deciding(tmp_path):
    run = ["--dataset", "synthetic", "--train-size", 96, "--test-size", 32, "--batch-size", 32, "--epochs", 3,
           "--target-accuracy", 0.0, "--log-every", 0, *TINY]
    off = run_in_process([*run, "--patience", 0, "--out-dir", tmp_path / "off"], check=True)
    assert "Early stopping" not in off.stdout and "Epoch 3/3 completed" in off.stdout
    held_out = run_in_process([*run, "--patience", 3, "--val-size", 32, "--out-dir", tmp_path / "val"], check=True)
    said = EARLY_STOPPING_LINE.findall(held_out.stdout)
    assert [s[:3] for s in said] == [("3", "0", "the validation split (--val-size 32)")], held_out.stdout


def test_compiled_ddp_run_saves_a_checkpoint_the_plain_model_loads(tmp_path):
    out = tmp_path / "run"
    # 200 images in batches of 64: a smaller last batch, in training and in evaluation.
    common = ["--dataset", "synthetic", "--train-size", 200, "--test-size", 50, "--batch-size", 64,
              "--epochs", 1, "--out-dir", out, *TINY]
    # Inductor compiles the kernels in each rank's own process, not in a pool of more interpreters (one per
    # core, each importing torch): the same kernels, without 4 more imports of torch on a 2-core machine.
    one_compiler = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    # the interpreter's own exit, as a user's compiled run ends (dynamo's caches, the compiled model)
    trained = launch([*common, "--compile"], nproc=2, env=one_compiler, fast_exit=False)
    assert "Training completed successfully." in trained.stdout
    state = load_model_state(out)["model"]
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state)  # unwrapped from compile and DDP
    WideResNet(10, 1, 100).load_state_dict(state)
    # another world size (1 process); compiled too (--evaluate takes the checkpoint's flags), so launched
    evaluated = launch([*common, "--evaluate"], torchrun=False, env=one_compiler)
    acc = float(re.search(r"Validation Accuracy: ([\d.]+)", evaluated.stdout).group(1))
    # The same weights; compiled and eager kernels may round differently, enough to flip one near-tie.
    assert acc == pytest.approx(read_jsonl(out / "metrics.jsonl")[-1]["val_acc"], abs=1 / 50 + 1e-9)


def test_a_run_ends_with_its_result_and_a_finished_run_is_never_rerun_silently(tmp_path):
    """The end of a run says what it got and where the checkpoint is; config.json keeps null as null and
    summary.json names CPU processes on a CPU; the Config line lists only what differs from the defaults.
    Rerun with the same command, the finished run says so and exits 0 (a requeue); with another batch, or
    --epochs at or below what it did, it is refused in one line naming the ways on; --epochs 3 trains on."""
    out = tmp_path / "run"
    run = ["--dataset", "synthetic", "--train-size", 128, "--test-size", 50, "--batch-size", 32,
           "--epochs", 2, "--out-dir", out, "--log-every", 0, *TINY]
    first = run_in_process(run, check=True)
    summary, config = read_json(out / "summary.json"), read_json(out / "config.json")
    metrics = read_jsonl(out / "metrics.jsonl")
    best = max(metrics, key=lambda m: m["val_acc"])
    assert first.stdout.splitlines()[-1] == (
        f"Result: final validation accuracy {summary['final_val_acc']:.4f} (epoch 2), best "
        f"{summary['best_val_acc']:.4f} (epoch {best['epoch']}); checkpoint {out}/checkpoint.pt")
    assert "Training completed successfully.\nResult: " in first.stdout  # after the original script's lines
    assert config["amp_dtype"] is None and config["micro_batch"] is None
    assert (summary["cpu_processes_per_node"] == summary["processes_per_node"] == 1
            and summary["gpus_per_node"] == 0)
    shown = json.loads(re.search(r"^Config: (\{.*\}) \(the rest: the defaults; all of it in ",
                                 first.stdout, re.M)[1])
    assert shown == {"batch_size": 32, "epochs": 2, "depth": 10, "widen_factor": 1, "dataset": "synthetic",
                     "train_size": 128, "test_size": 50, "workers": 0, "out_dir": str(out), "timeout": 120,
                     "log_every": 0}

    before = (out / "checkpoint.pt").stat().st_mtime_ns
    again = run_in_process(run)  # nothing trained: no fresh interpreter needed
    assert again.stdout.strip() == (f"{out}/checkpoint.pt holds a run trained for 2 epochs; final validation "
                                    f"accuracy {summary['final_val_acc']:.4f}, best "
                                    f"{summary['best_val_acc']:.4f}: nothing to train; --epochs N "
                                    f"(more than 2) trains it on, or another --out-dir starts afresh.")
    assert ((out / "checkpoint.pt").stat().st_mtime_ns == before
            and read_jsonl(out / "metrics.jsonl") == metrics)

    for changed, says in ((["--epochs", 1], "error: --epochs 1 leaves nothing to train: "),
                          (["--batch-size", 64], "this command changes it (resumed with changes: "
                                                 "--batch-size 32 -> 64) but trains nothing")):
        refused = run_in_process([*run, *changed])
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
        assert refused.returncode == 2 and len(errors) == 1 and says in errors[0], refused.stderr
        assert f"{out}/checkpoint.pt holds a run trained for 2 epochs" in errors[0]
        assert "--epochs N (more than 2) trains it on, or another --out-dir starts afresh" in errors[0]
        assert ("Training started" not in refused.stdout
                and (out / "checkpoint.pt").stat().st_mtime_ns == before)

    # A run that died after its last checkpoint, before its summary (a full disk, a lost node): the same
    # command trains nothing and writes the records it lacked.
    (out / "summary.json").unlink()
    repaired = run_in_process(run, check=True)
    assert "Epoch " not in repaired.stdout and "Training completed successfully." in repaired.stdout
    assert read_json(out / "summary.json")["final_val_acc"] == summary["final_val_acc"]
    assert ((out / "checkpoint.pt").stat().st_mtime_ns == before
            and read_jsonl(out / "metrics.jsonl") == metrics)
    more = run_in_process([*run, "--epochs", 3], check=True)
    assert ("Epoch 3/3 completed" in more.stdout
            and [m["epoch"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3])
    # The Config line shows what was given: the per-rank cap the resume keeps from the checkpoint is said
    # apart.
    config_line = re.search(r"^Config: (\{.*\}) \(the rest: the defaults, and the checkpoint's "
                            r"--micro-batch 32; all of it in ", more.stdout, re.M)
    assert config_line and json.loads(config_line[1]) == {**shown, "epochs": 3}, more.stdout
