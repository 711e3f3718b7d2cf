"""bench-results/gpu_checklist.py, the GPU machine's one script, run as its dry run on the CPU: every step end to
end on tiny configurations, so that the script a GPU's few minutes go to cannot rot unnoticed; and cut short by its
budget, or without Fashion-MNIST, it still ends cleanly and says what ran."""
import os
import subprocess
import sys
import tarfile

import pytest

from support import ROOT, read_json, run_env

FASHION = "/usr/share/datasets/fashion-mnist"
CHECKLIST = os.path.join(ROOT, "bench-results", "gpu_checklist.py")
STEPS = ["bench", "tests", "fashion", "exactness", "candidates"]  # in order of value


def dry_run(tmp_path, *flags):
    """The checklist's --dry-run with $OUT set as the device tool sets it: (its output, $OUT's summary.json)."""
    out = tmp_path / "out"  # as the device tool's $OUT: what comes back from the GPU machine
    out.mkdir()
    proc = subprocess.run([sys.executable, CHECKLIST, "--dry-run", "--results", tmp_path / "results", *flags],
                          cwd=ROOT, env={**run_env(1), "OUT": str(out)}, capture_output=True, text=True, timeout=1800)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert sorted(os.listdir(out)) == ["results.tar.gz", "summary.json", "summary.md"]  # the tool's 8 files at most
    return proc, read_json(out / "summary.json")


def test_the_gpu_checklist_s_dry_run_runs_every_step_on_the_cpu_and_brings_back_its_results(tmp_path):
    if not os.path.exists(f"{FASHION}/t10k-labels-idx1-ubyte.gz") and os.environ.get("CI") != "true":
        pytest.skip(f"no Fashion-MNIST in {FASHION} (apt-get install dataset-fashion-mnist)")
    proc, summary = dry_run(tmp_path, "--fashion-dir", FASHION)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = summary["steps"]
    assert list(steps) == STEPS
    assert {name: s["state"] for name, s in steps.items()} == dict.fromkeys(steps, "ok"), proc.stdout
    assert summary["probe"]["torch"] and "dev_shm_free_gib" in summary["probe"]
    assert steps["tests"]["passed"] == steps["tests"]["run"] == steps["tests"]["expected"] >= 2
    assert steps["tests"]["not_run"] == 0
    assert steps["bench"]["images_per_s"] > 0 and steps["bench"]["mfu"] is None  # no tensor-core peak on a CPU
    fashion = steps["fashion"]  # the time to a target comes from the run's own records
    assert fashion["epochs"] == 1 and 0 <= fashion["final_acc"] <= 1 and fashion["train_s"] > 0
    assert "--batch-size" in fashion["command"] and not os.path.exists(fashion["out_dir"])  # in memory, then gone
    # On the CPU, one thread per process: a resume mid-epoch and 1 x 2 micro-steps against 2 x 1, bit for bit.
    comparisons = steps["exactness"]["deterministic"]["comparisons"]
    assert set(comparisons) == {"resumed mid-epoch", "1 x 2 micro-steps against 2 x 1"}
    assert all(c["equal"] == c["tensors"] > 0 for c in comparisons.values()), comparisons
    rows = steps["candidates"]["rows"]
    assert {"default", "default, again", "compile-mode reduce-overhead", "compile-mode max-autotune-no-cudagraphs",
            "optimizer step compiled"} <= set(rows)
    assert all(r["images_per_s"] > 0 and r["ratio"] > 0 and r["cudagraph_skips"] == 0 for r in rows.values())
    assert steps["candidates"]["evaluation"]["eval_s"] > 0
    report = (tmp_path / "out" / "summary.md").read_text()
    assert "**Speed candidates**" in report and "**Exactness, deterministic**: resumed mid-epoch: " in report
    assert "**GPU tests**: 2 passed, 0 failed, 0 skipped of 2 run; 2 expected, 0 not run" in report
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        files = {os.path.basename(name) for name in tar.getnames()}
    assert {"tests.log", "bench.json", "candidates.json", "fashion.log", "fashion-metrics.jsonl",
            "summary.json"} <= files


def test_a_dry_run_cut_by_its_budget_ends_cleanly_and_says_which_steps_were_cut_or_not_reached(tmp_path):
    """40 s for five steps on the CPU, without Fashion-MNIST: its first lines say the data are missing, the other
    steps run in order as the budget allows, whatever got done is kept, and summary.json and summary.md list every
    step, each ok, cut or not reached (Fashion-MNIST: skipped)."""
    proc, summary = dry_run(tmp_path, "--budget", "40", "--fashion-dir", tmp_path / "no-fashion")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = "".join(proc.stdout.splitlines(keepends=True)[:3])
    assert f"no Fashion-MNIST in {tmp_path / 'no-fashion'}: the fashion step is skipped" in first, proc.stdout
    steps = summary["steps"]
    assert list(steps) == STEPS
    assert steps["fashion"]["state"] == "skipped"
    states = [steps[name]["state"] for name in STEPS if name != "fashion"]
    assert set(states) <= {"ok", "cut", "not reached"} and {"cut", "not reached"} & set(states), steps
    assert summary["seconds"] < 40 + 30  # the budget, and the probe and packing around it
    report = (tmp_path / "out" / "summary.md").read_text()
    for name in STEPS:
        assert f"| {name} | {steps[name]['state']} | " in report, report
