"""What a run leaves for its user to read and look at: progress lines (in a batch log, and one live line
on a terminal), run.json, TensorBoard scalars, and plot.py's plots (where they land by default, and
what it says of a run with no finished epoch)."""
import os
import pty
import re
import subprocess
import sys

import pytest
import torch

from support import (ROOT, TINY, launch, launch_forked, read_json, read_jsonl, require_package,
                     run_in_process, threads_per_rank)

# 256 samples / 32 = 8 steps per epoch.
SMALL = ["--dataset", "synthetic", "--train-size", 256, "--test-size", 50, "--batch-size", 32,
         "--epochs", 2, *TINY]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two runs of SMALL, seeds 0 and 1: the first on 2 ranks (its log and run.json), the second, only plotted
    beside it, in one process (in this one)."""
    base = tmp_path_factory.mktemp("runs")
    first = launch_forked([*SMALL, "--out-dir", base / "first", "--seed", 0, "--log-every", 4], nproc=2)
    run_in_process([*SMALL, "--out-dir", base / "second", "--seed", 1, "--log-every", 4], check=True)
    return base / "first", base / "second", first.stdout


def test_progress_lines_in_batch_logs_come_after_the_first_step_then_every_n_from_rank_0(two_runs):
    _, _, log = two_runs
    lines = re.findall(r"^  epoch (\d) step (\d)/8 \| \d+ img/s \| loss \d+\.\d{4} \| epoch ETA \d+ s \| run "
                       r"ETA (?:\d+ h )?\d+ (?:min|s)$", log, re.M)
    # After the first step (signs of life on a slow start: no ETA yet, as the step carries the start-up), then
    # every 4 steps; from rank 0 only.
    first = re.findall(r"^  epoch 1 step 1/8 \| \d+ img/s \| loss \d+\.\d{4} \| ETA: from the next steps' pace "
                       r"\(this one carries the start-up\)$", log, re.M)
    assert len(first) == 1 and lines == [("1", "4"), ("1", "8"), ("2", "4"), ("2", "8")], log


def test_run_json_records_the_config_every_rank_the_versions_the_commit_and_the_times(two_runs):
    first, _, _ = two_runs
    run = read_json(first / "run.json")
    assert run["config"] == read_json(first / "config.json")
    assert run["config"]["seed"] == 0 and run["config"]["world_size"] == 2 and run["world_size"] == 2
    assert ([r["rank"] for r in run["ranks"]] == [0, 1]
            and all(r["host"] and r["device"] for r in run["ranks"]))
    assert run["versions"]["torch"] == torch.__version__
    assert run["versions"]["python"] == sys.version.split()[0]
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: the commit the code is at, and whether it was changed
        assert run["git_commit"] == head.stdout.strip() and isinstance(run["git_dirty"], bool)
    else:
        assert run["git_commit"] is None
    assert run["start_time"] <= run["end_time"]
    assert run["slurm"] == {k: v for k, v in os.environ.items()
                            if k.startswith("SLURM_") and "TOKEN" not in k}


def test_plot_draws_one_titled_figure_of_loss_accuracy_throughput_lr_and_each_rank_s_time(two_runs, tmp_path):
    require_package("matplotlib")
    import plot
    first, second, _ = two_runs
    path = str(tmp_path / "both.png")
    (figure,) = plot.plot_runs([str(first), str(second)], path).values()
    png = (tmp_path / "both.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the model, the global batch and the LR
    assert figure._suptitle.get_text() == ("WRN-10-1, global batch 32, peak LR 0.000625 (synthetic "
                                           "(learnable, of CIFAR-100's shape))")
    loss, accuracy, throughput, lr, ranks = figure.axes
    assert [ax.get_ylabel() for ax in (loss, accuracy, throughput, lr)] == [
        "loss", "top-1 accuracy", "training images/s", "LR (epoch's end)"]
    labels = [line.get_label() for line in accuracy.get_lines()]
    assert labels == ["first train", "first test", "second train", "second test"]  # what each accuracy is
    assert [line.get_label() for line in loss.get_lines()] == labels
    rows = read_jsonl(first / "metrics.jsonl")
    assert list(accuracy.get_lines()[0].get_ydata()) == [m["train_acc"] for m in rows]
    # Throughput from epoch 2 on; epoch 1, which holds the start-up, marked apart.
    first_ips, first_start = throughput.get_lines()[:2]
    assert list(first_ips.get_xdata()) == [2] and list(first_start.get_xdata()) == [1]
    assert first_start.get_label() == "first: epoch 1, with the start-up (a new run's or a resume's)"
    # The LR of each run, in its colour and named (not in every panel)
    assert [(line.get_label(), line.get_color()) for line in lr.get_lines()] == [
        (name, line.get_color()) for name, line in zip(("first", "second"), accuracy.get_lines()[::2])]
    # Each rank's split of its step time in each run's last epoch: a bar per rank named by run, a colour per
    # phase.
    second_rows = read_jsonl(second / "metrics.jsonl")
    assert [t.get_text() for t in ranks.get_yticklabels()] == (
        [f"first: rank {r['rank']} ({r['host']})" for r in rows[-1]["rank_times"]]
        + [f"second: rank {r['rank']} ({r['host']})" for r in second_rows[-1]["rank_times"]])
    assert ([t.get_text() for t in ranks.get_legend().get_texts()]
            == ["data", "compute", "sync", "optimizer", "other"])
    figure.canvas.draw()  # the legends sit beside the curves, not over them
    for ax in (loss, accuracy, throughput):
        assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1


def test_plot_draws_the_seeds_of_one_configuration_as_their_mean_with_a_band(two_runs, tmp_path):
    require_package("matplotlib")
    import plot
    first, second, _ = two_runs
    for i, run in enumerate((first, second)):  # two seeds of one configuration
        (tmp_path / f"cfg-seed{i}").mkdir()
        (tmp_path / f"cfg-seed{i}" / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    (figure,) = plot.plot_runs([str(tmp_path / "cfg-seed0"), str(tmp_path / "cfg-seed1")],
                               str(tmp_path / "cfg.png")).values()
    ax, ax_lr = figure.axes[0], figure.axes[3]
    rows = [read_jsonl(run / "metrics.jsonl") for run in (first, second)]
    train, val = ax.get_lines()
    assert train.get_label() == "cfg train (2 seeds)" and val.get_linestyle() == "--"
    assert train.get_color() == val.get_color()  # one colour per configuration, a style per quantity
    assert list(train.get_ydata()) == [pytest.approx((a["train_loss"] + b["train_loss"]) / 2)
                                       for a, b in zip(*rows)]
    assert len(ax.collections) == 2  # a band (min to max over the seeds) per quantity
    assert list(ax_lr.get_lines()[0].get_ydata()) == [m["lr"] for m in rows[0]]


def test_plot_marks_a_resumed_run_s_first_epoch_as_holding_a_start_up_as_it_marks_epoch_1(tmp_path):
    """3 epochs, stopped after epoch 1 and resumed: epochs 1 and 2 each began in a new process (slower),
    epoch 3 did not. The records say which; the plot joins only epoch 3 and marks 1 and 2 apart."""
    require_package("matplotlib")
    import plot
    out = tmp_path / "resumed"
    run = [*SMALL, "--epochs", 3, "--out-dir", out, "--log-every", 0]
    run_in_process([*run, "--stop-after-epoch", 1], check=True)
    run_in_process(run, check=True)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [m.get("includes_start_up", False) for m in rows] == [True, True, False]
    (figure,) = plot.plot_runs([str(out)], str(tmp_path / "resumed.png")).values()
    joined, apart = figure.axes[2].get_lines()[:2]
    assert list(joined.get_xdata()) == [3] and list(apart.get_xdata()) == [1, 2]
    assert apart.get_label() == "resumed: epochs 1, 2, with the start-up (a new run's or a resume's)"


def test_tensorboard_logs_every_epoch_metric_as_a_scalar(tmp_path):
    """--tensorboard: each epoch's row of metrics.jsonl, as scalars TensorBoard reads back at that epoch."""
    require_package("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    run_in_process([*SMALL, "--out-dir", out, "--tensorboard"], check=True)  # the records, not the process
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 2
    # not rank_times' list, nor a mark (includes_start_up: epoch 1's alone)
    numbers = [key for key, value in rows[0].items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)]
    assert set(events.Tags()["scalars"]) == set(numbers)  # every number, nothing else
    for key in numbers:
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (row["epoch"], pytest.approx(row[key], rel=1e-6)) for row in rows], key


def test_tensorboard_without_the_package_is_refused_in_one_line_before_anything_is_written(tmp_path):
    """A tensorboard that cannot be imported (here a stand-in package that raises ImportError, first on
    PYTHONPATH) is refused at the start, with the pip command, and nothing is written."""
    stub = tmp_path / "stub" / "tensorboard"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('tensorboard is not installed (a test stand-in)')\n")
    out = tmp_path / "run"
    proc = launch([*SMALL, "--epochs", 1, "--out-dir", out, "--tensorboard"], torchrun=False, check=False,
                  env={"PYTHONPATH": tmp_path / "stub"})  # first, then the inherited one
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: --tensorboard needs the tensorboard package: pip install tensorboard")
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(out) or os.listdir(out) == []


def test_progress_is_one_live_line_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    args = [str(a) for a in [*SMALL, "--epochs", 1, "--train-size", 640, "--out-dir", tmp_path / "run"]]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_ddp.py"), *args], cwd=ROOT,
                            stdout=slave, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": threads_per_rank(1)})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    out = b"".join(chunks).decode()
    # 20 steps: the line is drawn after the first step, redrawn in place (\r) every 10, then cleared.
    assert re.findall(r"\r  epoch 1 step (\d+)/20 \| \d+ img/s", out) == ["1", "10", "20"]
    assert not re.search(r"^  epoch \d step", out, re.M)
    assert "Epoch 1/1 completed in" in out


def test_plot_of_a_run_with_no_finished_epoch_says_so_and_draws_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")  # what a run interrupted in its first epoch leaves
    proc = launch([run, "--out", tmp_path / "plots"], torchrun=False, script="plot.py", check=False)
    assert proc.returncode == 1 and f"error: {run} has no finished epoch yet" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "plots").exists() or not os.listdir(tmp_path / "plots")


def test_plot_writes_beside_one_run_or_named_after_several_in_runs_plots_which_git_ignores(two_runs,
                                                                                           tmp_path):
    """Without --out, one run's figure goes beside it (RUN/curves.png); several runs' to runs/plots/ of the
    directory plot.py runs in, named after them, so that a call on other runs never overwrites it; in the
    project directory, git ignores runs/."""
    require_package("matplotlib")
    first, second, _ = two_runs
    proc = launch([first, second], torchrun=False, script="plot.py", cwd=tmp_path)
    assert proc.stdout.split() == [os.path.join("runs", "plots", "first+second.png")]
    launch([second, first], torchrun=False, script="plot.py", cwd=tmp_path)  # other runs, or another order
    assert sorted(os.listdir(tmp_path / "runs" / "plots")) == ["first+second.png", "second+first.png"]
    assert sorted(os.listdir(tmp_path)) == ["runs"]  # nothing else, anywhere else here
    proc = launch([first], torchrun=False, script="plot.py", cwd=tmp_path)
    assert proc.stdout.split() == [str(first / "curves.png")] and (first / "curves.png").is_file()
    ignored = subprocess.run(["git", "-C", ROOT, "check-ignore", "runs/plots/first+second.png"],
                             capture_output=True, text=True)
    if ignored.returncode != 128:  # 128: not a git checkout
        assert ignored.stdout.split() == ["runs/plots/first+second.png"]


def test_each_epoch_s_row_holds_the_run_s_training_seconds_so_far_and_summary_json_the_time_to_the_target(tmp_path):
    """metrics.jsonl: each epoch's evaluation seconds, and the run's training seconds (and with evaluation) up to its
    end, across a resume; summary.json: the first epoch at --target-accuracy and those seconds then (a time to an
    accuracy, read off the run's own records)."""
    out = tmp_path / "run"
    run = ["--dataset", "synthetic", "--train-size", 1024, "--test-size", 256, "--batch-size", 32, "--epochs", 3,
           "--base-lr", 0.05, "--reference-batch-size", 32, "--warmup-epochs", 0, *TINY, "--log-every", 0,
           "--patience", 0, "--out-dir", out]
    run_in_process([*run, "--stop-after-epoch", 2], check=True)
    first, second = read_jsonl(out / "metrics.jsonl")
    assert second["val_acc"] > first["val_acc"], (first, second)  # it learns (11% -> 20%, measured): epoch 2 is the
    # first at its accuracy
    target = second["val_acc"]
    run_in_process([*run, "--target-accuracy", target], check=True)  # resumed for epoch 3
    rows = read_jsonl(out / "metrics.jsonl")
    assert [m["epoch"] for m in rows] == [1, 2, 3] and all(m["eval_time_s"] > 0 for m in rows)
    for i, m in enumerate(rows):
        assert m["train_time_s"] == pytest.approx(sum(r["epoch_time_s"] for r in rows[:i + 1]), rel=1e-9)
        assert m["run_time_s"] == pytest.approx(sum(r["epoch_time_s"] + r["eval_time_s"] for r in rows[:i + 1]),
                                                rel=1e-9)
    summary = read_json(out / "summary.json")
    assert summary["target_accuracy"] == target and summary["target_epoch"] == 2
    assert summary["target_train_time_s"] == rows[1]["train_time_s"] < rows[2]["train_time_s"]
    assert summary["target_run_time_s"] == rows[1]["run_time_s"]
