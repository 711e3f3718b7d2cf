"""bench-results/gpu_checklist.py, the GPU machine's one script, run as its dry run on the CPU: every step end to
end on tiny configurations, so that the script a GPU's few minutes go to cannot rot unnoticed."""
import os
import subprocess
import sys
import tarfile

import pytest

from support import ROOT, read_json, run_env

FASHION = "/usr/share/datasets/fashion-mnist"


def test_the_gpu_checklist_s_dry_run_runs_every_step_on_the_cpu_and_brings_back_its_results(tmp_path):
    if not os.path.exists(f"{FASHION}/t10k-labels-idx1-ubyte.gz") and os.environ.get("CI") != "true":
        pytest.skip(f"no Fashion-MNIST in {FASHION} (apt-get install dataset-fashion-mnist)")
    out = tmp_path / "out"  # as the device tool's $OUT: what comes back from the GPU machine
    out.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench-results", "gpu_checklist.py"), "--dry-run",
                           "--fashion-dir", FASHION, "--results", tmp_path / "results"], cwd=ROOT,
                          env={**run_env(1), "OUT": str(out)}, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(out)) == ["results.tar.gz", "summary.json", "summary.md"]  # the tool's 8 files at most
    summary = read_json(out / "summary.json")
    steps = summary["steps"]
    assert list(steps) == ["tests", "bench", "candidates", "fashion", "exactness"]  # in order of value
    assert {name: s["status"] for name, s in steps.items()} == dict.fromkeys(steps, "ok"), proc.stdout
    assert steps["tests"]["passed"] == steps["tests"]["tests"] >= 2
    assert steps["bench"]["images_per_s"] > 0 and steps["bench"]["original_images_per_s"] > 0
    rows = steps["candidates"]["rows"]
    assert {"default", "default, again", "compile-mode reduce-overhead", "compile-mode max-autotune-no-cudagraphs",
            "optimizer step compiled", "--deterministic (own process)"} <= set(rows)
    assert all(r["images_per_s"] > 0 and r["ratio"] > 0 for r in rows.values())
    assert steps["candidates"]["evaluation"]["eval_s"] > 0
    fashion = steps["fashion"]  # the time to a target comes from the run's own records
    assert fashion["epochs"] == 1 and 0 <= fashion["final_acc"] <= 1 and fashion["train_s"] > 0
    # On the CPU, one thread per process: a resume mid-epoch and 1 x 2 micro-steps against 2 x 1, bit for bit.
    comparisons = steps["exactness"]["deterministic"]["comparisons"]
    assert set(comparisons) == {"resumed mid-epoch", "1 x 2 micro-steps against 2 x 1"}
    assert all(c["equal"] == c["tensors"] > 0 for c in comparisons.values()), comparisons
    report = (out / "summary.md").read_text()
    assert "**Speed candidates**" in report and "**Exactness, deterministic**: resumed mid-epoch: " in report
    with tarfile.open(out / "results.tar.gz") as tar:
        files = {os.path.basename(name) for name in tar.getnames()}
    assert {"tests.log", "bench.json", "candidates.json", "deterministic.json", "fashion.log",
            "fashion-metrics.jsonl", "summary.json"} <= files
