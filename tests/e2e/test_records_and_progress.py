"""What users read and look at: progress lines, run records, plots, the benchmark, the preflight check."""
import importlib.util
import os
import re

import pytest
import torch

from conftest import ROOT, TINY, launch, read_json, read_jsonl

# 256 samples / 32 = 8 steps per epoch.
SMALL = ["--dataset", "synthetic", "--train-size", 256, "--test-size", 50, "--batch-size", 32, "--epochs", 2, *TINY]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    procs = [launch([*SMALL, "--out-dir", base / name, "--seed", seed, "--log-every", 4], nproc=2)
             for name, seed in (("first", 0), ("second", 1))]
    return base / "first", base / "second", procs[0].stdout


def test_progress_lines_in_batch_logs(two_runs):
    _, _, log = two_runs
    lines = re.findall(r"^  epoch (\d) step (\d)/8 \| \d+ img/s \| loss \d+\.\d{4} \| epoch ETA \d+ s$", log, re.M)
    # After the first step (signs of life on a slow start), then every 4 steps; from rank 0 only.
    assert lines == [("1", "1"), ("1", "4"), ("1", "8"), ("2", "4"), ("2", "8")]


def test_run_record(two_runs):
    first, _, _ = two_runs
    run = read_json(first / "run.json")
    assert run["config"]["seed"] == 0 and run["config"]["world_size"] == 2 and run["world_size"] == 2
    assert [r["rank"] for r in run["ranks"]] == [0, 1] and all(r["host"] and r["device"] for r in run["ranks"])
    assert run["versions"]["torch"] == torch.__version__ and run["versions"]["python"]
    assert run["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", run["git_commit"])
    assert run["start_time"] <= run["end_time"]
    assert isinstance(run["slurm"], dict)


def test_run_plots(two_runs, tmp_path):
    plot = pytest.importorskip("plot")
    pytest.importorskip("matplotlib")
    first, second, _ = two_runs
    figures = plot.plot_runs([str(first), str(second)], str(tmp_path))
    # Two runs: train and validation loss each, top-1 and top-5 each, one throughput curve each.
    expected = {"loss.png": 4, "accuracy.png": 4, "throughput.png": 2}
    for name, curves in expected.items():
        lines = figures[name].axes[0].get_lines()
        assert len(lines) == curves, name
        assert all(list(line.get_xdata()) == [1, 2] for line in lines)
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    labels = [t.get_text() for t in figures["loss.png"].axes[0].get_legend().get_texts()]
    assert labels == ["first train", "first validation", "second train", "second validation"]


def test_benchmark_runs_and_scaling_plot(tmp_path):
    results = []
    for n in (1, 2):
        path = tmp_path / f"bench-{n}.json"
        ddp_options = ["--static-graph", "--bucket-cap-mb", 1] if n == 2 else []
        proc = launch(["--depth", 10, "--widen-factor", 1, "--batch-size", 32 * n, "--steps", 4, "--warmup", 2,
                       "--device", "cpu", "--json", path, *ddp_options], nproc=n, script="bench.py")
        assert re.search(r"^ours: \d+ img/s, \d+ img/s per cpu, step [\d.]+ ms \(data [\d.]+ ms, "
                         r"fwd\+bwd [\d.]+ ms, optimizer [\d.]+ ms, exposed comm ", proc.stdout, re.M)
        assert re.search(r"^augmentation of one 50000-image epoch on one cpu: [\d.]+ ms$", proc.stdout, re.M)
        results.append(read_json(path))
    assert [r["world_size"] for r in results] == [1, 2]
    assert results[1]["config"]["static_graph"] and results[1]["config"]["bucket_cap_mb"] == 1
    assert results[0]["ours"]["exposed_comm_s"] is None and results[1]["ours"]["exposed_comm_s"] is not None
    # WRN-10-1: 12.5M multiply-adds forward (2 FLOPs each), and the backward pass costs about twice that.
    assert results[0]["ours"]["flops_per_image"] == pytest.approx(3 * 2 * 12.5e6, rel=0.05)
    assert results[0]["ours"]["mfu"] is None  # no peak for CPUs
    plot = pytest.importorskip("plot")
    pytest.importorskip("matplotlib")
    fig = plot.plot_scaling([str(tmp_path / "bench-1.json"), str(tmp_path / "bench-2.json")], str(tmp_path))
    ax, ax2 = fig["scaling.png"].axes
    assert len(ax.get_lines()) == 2 and len(ax2.get_lines()) == 1  # measured, ideal; efficiency
    assert list(ax.get_lines()[0].get_xdata()) == [1, 2]
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


def test_preflight_passes_and_reports_every_rank(tmp_path):
    proc = launch(["--dataset", "synthetic", "--out-dir", tmp_path / "out", "--device", "cpu"], nproc=2,
                  script="preflight.py")
    out = proc.stdout
    assert "backend gloo; torch" in out and "world size 2" in out
    rows = re.findall(r"^ +(\d) +(\d) +\S+ +cpu .* ok$", out, re.M)
    assert rows == [("0", "0"), ("1", "1")]
    assert re.search(r"^all_reduce bus bandwidth: 1 MiB [\d.]+ GB/s, 4 MiB [\d.]+ GB/s, 16 MiB [\d.]+ GB/s$", out, re.M)
    assert out.strip().endswith("preflight: all checks passed")


def test_preflight_fails_when_a_node_lacks_the_data(tmp_path):
    empty = tmp_path / "nodata"
    empty.mkdir()
    proc = launch(["--data-dir", empty, "--out-dir", tmp_path / "out", "--device", "cpu"], nproc=2,
                  script="preflight.py", check=False)
    assert proc.returncode == 1
    assert "FAILED: rank 0 on" in proc.stderr and f"neither {empty}/cifar-100-python/ nor" in proc.stderr
    assert "all checks passed" not in proc.stdout


def test_tensorboard(tmp_path):
    out = tmp_path / "run"
    proc = launch([*SMALL, "--epochs", 1, "--out-dir", out, "--tensorboard"], torchrun=False, check=False)
    if importlib.util.find_spec("tensorboard") is None:
        assert proc.returncode == 2 and "error: --tensorboard needs the tensorboard package: pip install" in proc.stderr
        assert not os.path.exists(out)
    else:  # the epoch's metrics, as scalars TensorBoard reads back
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        assert proc.returncode == 0, proc.stderr
        events = EventAccumulator(str(out / "tensorboard"))
        events.Reload()
        row = read_jsonl(out / "metrics.jsonl")[0]
        for key in ("train_loss", "val_loss", "val_acc", "lr"):
            assert [(e.step, e.value) for e in events.Scalars(key)] == [(1, pytest.approx(row[key], rel=1e-6))]


def test_benchmark_cpu_checks_report(tmp_path):
    path = tmp_path / "cpu.json"
    proc = launch(["--cpu-checks", "--depth", 10, "--widen-factor", 1, "--batch-size", 16, "--json", path],
                  torchrun=False, script="bench.py")
    assert re.search(r"^augmentation, 1 core: PIL per sample \d+ img/s, batched tensor ops \d+ img/s: [\d.]+x$",
                     proc.stdout, re.M)
    assert re.search(r"^loop overhead \(WRN-10-1, batch 16\): [\d.]+ ms/step vs bare [\d.]+ ms/step: -?[\d.]+%; "
                     r"the data path alone [\d.]+ ms/step", proc.stdout, re.M)
    result = read_json(path)["cpu_checks"]
    assert result["augmentation"]["speedup"] > 0 and 0 < result["loop_overhead"]["data_path_s"]


def test_progress_is_one_live_line_on_a_terminal(tmp_path):
    import pty
    import subprocess
    import sys
    from conftest import ROOT
    master, slave = pty.openpty()
    args = [str(a) for a in [*SMALL, "--epochs", 1, "--train-size", 640, "--out-dir", tmp_path / "run"]]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_ddp.py"), *args], cwd=ROOT,
                            stdout=slave, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "2"})
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


def test_plot_of_a_run_with_no_finished_epoch_says_so_and_outputs_go_where_git_ignores(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")  # what a run interrupted in its first epoch leaves
    proc = launch([run, "--out", tmp_path / "plots"], torchrun=False, script="plot.py", check=False)
    assert proc.returncode == 1 and f"error: {run} has no finished epoch yet" in proc.stderr
    assert not (tmp_path / "plots").exists() or not os.listdir(tmp_path / "plots")
    import subprocess
    from conftest import ROOT
    ignored = subprocess.run(["git", "-C", ROOT, "check-ignore", "runs/plots/loss.png", "runs/bench/bench-cpu-1x.json"],
                             capture_output=True, text=True)
    if ignored.returncode != 128:  # 128: not a git checkout
        assert ignored.stdout.split() == ["runs/plots/loss.png", "runs/bench/bench-cpu-1x.json"]
    for script, default in (("plot.py", "runs/plots"), ("bench.py", "runs/bench/")):
        assert default in open(os.path.join(ROOT, script)).read()


def test_readme_one_minute_cpu_run_shows_learning(tmp_path):
    """The README's first run on a laptop: its synthetic classes can be learned, so it ends far above
    chance (1%), at 50% top-1 or more."""
    with open(os.path.join(ROOT, "README.md")) as f:
        command = next(line for line in f if line.startswith(".venv/bin/python train_ddp.py --dataset synthetic"))
    args = command.split()[2:]
    args[args.index("--out-dir") + 1] = str(tmp_path / "cpu-try")
    proc = launch([*args, "--log-every", 0], torchrun=False)
    accuracies = [float(a) for a in re.findall(r"Validation Accuracy: ([\d.]+)", proc.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] >= 0.5 and accuracies[0] < accuracies[-1], proc.stdout
