"""The tools beside the recipe, run as users run them: bench.py (throughput, the step's phases, FLOPs,
DDP's options, the CPU checks, and where its JSON lands by default), plot.py --scaling on its
results, and preflight.py (every rank reported; a node without the data fails it)."""
import os
import re
import subprocess

import pytest

from support import ROOT, TINY, launch, launch_forked, read_json, require_package


@pytest.fixture(scope="module")
def bench_one_process(tmp_path_factory):
    """bench.py in one plain process, without --json, run in a folder of its own: (its folder, its output)."""
    cwd = tmp_path_factory.mktemp("bench")
    proc = launch(["--depth", 10, "--widen-factor", 1, "--batch-size", 32, "--steps", 4, "--warmup", 2,
                   "--device", "cpu"], torchrun=False, script="bench.py", cwd=cwd)
    return cwd, proc


def test_benchmark_runs_and_scaling_plot(tmp_path, bench_one_process):
    results, paths = [], []
    for n in (1, 2):
        if n == 1:  # plain python, its JSON where it writes it by default
            cwd, proc = bench_one_process
            (path,) = (cwd / "runs" / "bench").iterdir()
        else:
            path = tmp_path / "bench-2.json"
            # --train-size: fewer synthetic images than CIFAR-100's 50,000, the augmentation epoch's too
            proc = launch(["--depth", 10, "--widen-factor", 1, "--batch-size", 64, "--steps", 4,
                           "--warmup", 2, "--device", "cpu", "--json", path, "--static-graph",
                           "--bucket-cap-mb", 1, "--train-size", 4096, "--compare-original", "--workers", 1],
                          nproc=2, script="bench.py")
            assert re.search(r"^the original script's pipeline: \d+ img/s; ours is [\d.]+x$", proc.stdout, re.M)
        assert re.search(r"^ours: \d+ img/s, \d+ img/s per cpu, step [\d.]+ ms ", proc.stdout, re.M)
        assert re.search(r"^ours, phases .*: data [\d.]+ ms, fwd\+bwd [\d.]+ ms, optimizer [\d.]+ ms, "
                         r"exposed comm "
                         + (r"[\d.]+ ms$" if n == 2 else r"n/a$"), proc.stdout, re.M)
        images = 50000 if n == 1 else 4096
        assert re.search(rf"^augmentation of one {images}-image epoch on one cpu: [\d.]+ ms$", proc.stdout,
                         re.M)
        results.append(read_json(path))
        paths.append(str(path))
    assert [r["world_size"] for r in results] == [1, 2]
    assert results[1]["config"]["static_graph"] and results[1]["config"]["bucket_cap_mb"] == 1
    assert [r["ours"]["augment_epoch_images"] for r in results] == [50000, 4096]
    assert results[0]["ours"]["phases"]["exposed_comm_s"] is None  # one rank: no communication
    assert results[1]["ours"]["phases"]["exposed_comm_s"] is not None
    # WRN-10-1: 12.5M multiply-adds forward (2 FLOPs each), and the backward pass costs about twice that.
    assert results[0]["ours"]["flops_per_image"] == pytest.approx(3 * 2 * 12.5e6, rel=0.05)
    assert results[0]["ours"]["mfu"] is None  # no peak for CPUs
    assert results[1]["speedup_vs_original"] == pytest.approx(results[1]["ours"]["images_per_s"]
                                                              / results[1]["original"]["images_per_s"])
    require_package("matplotlib")
    import plot
    fig = plot.plot_scaling(paths, str(tmp_path))
    ax, ax2 = fig["scaling.png"].axes
    assert len(ax.get_lines()) == 2 and len(ax2.get_lines()) == 1  # measured, ideal; efficiency
    assert list(ax.get_lines()[0].get_xdata()) == [1, 2]
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


def test_benchmark_cpu_checks_alone_runs_the_small_config_and_reports_both_checks(tmp_path):
    """--cpu-checks without a model or batch: WRN-10-1 at batch 64 (not the recipe's WRN-16-8 at 512); the
    augmentation comparison and the loop-overhead check, in the log and in the JSON."""
    path = tmp_path / "cpu.json"
    proc = launch(["--cpu-checks", "--rounds", 2, "--json", path], torchrun=False, script="bench.py")
    assert re.search(r"^augmentation, 1 core: PIL per sample \d+ img/s, torchvision v2 per sample \(the "
                     r"DataLoader workers'\) \d+ img/s, batched tensor ops \d+ img/s: [\d.]+x$", proc.stdout, re.M)
    assert re.search(r"^loop overhead \(WRN-10-1, batch 64\): [\d.]+ ms/step vs bare [\d.]+ ms/step: "
                     r"-?[\d.]+%; the data path alone [\d.]+ ms/step", proc.stdout, re.M)
    result = read_json(path)
    assert (result["config"]["depth"], result["config"]["widen_factor"],
            result["config"]["batch_size"]) == (10, 1, 64)
    checks = result["cpu_checks"]
    assert checks["augmentation"]["speedup"] > 0 and 0 < checks["loop_overhead"]["data_path_s"]
    assert checks["loop_overhead"]["model"] == "WRN-10-1" and checks["loop_overhead"]["batch"] == 64
    assert "ours" not in result  # the checks alone, not the GPU benchmark on a CPU


def test_bench_writes_its_json_to_runs_bench_by_default_which_git_ignores(bench_one_process):
    """Without --json, bench.py writes runs/bench/bench-<device>-<world size>x.json under the directory
    it runs in; in the project directory, git ignores that."""
    cwd, proc = bench_one_process
    written = os.listdir(cwd / "runs" / "bench")
    assert len(written) == 1 and re.fullmatch(r"bench-\w+-1x\.json", written[0]), written
    result = read_json(cwd / "runs" / "bench" / written[0])
    assert result["world_size"] == 1 and result["config"]["batch_size"] == 32
    assert f"wrote {os.path.join('runs', 'bench', written[0])}" in proc.stdout
    assert sorted(os.listdir(cwd)) == ["runs"], proc.stdout  # nothing else, anywhere else here
    ignored = subprocess.run(["git", "-C", ROOT, "check-ignore", f"runs/bench/{written[0]}"],
                             capture_output=True, text=True)
    if ignored.returncode != 128:  # 128: not a git checkout
        assert ignored.stdout.split() == [f"runs/bench/{written[0]}"]


def test_loader_check_reads_the_run_s_image_folder_on_every_rank_and_its_verdict_follows_its_own_figures(
        tmp_path):
    """bench.py --loader-check beside a train_ddp.py adapted to the README's image-folder reader, as a user runs it
    after adapting: on 2 ranks it reads the real PNG files with the run's loader and worker, and its verdict is the
    one its measured figures make (which no test can choose: the machine's speed does)."""
    from test_adapt import ADAPTED_ENV, adapted_script, readme_load_data, write_fashion_pngs
    from tools.loader_check import name_fixes
    pngs = write_fashion_pngs(tmp_path / "pngs", 320, 64)
    code = tmp_path / "code"
    adapted_script(code, load_data=readme_load_data("image folders"))
    (code / "bench.py").write_text(open(os.path.join(ROOT, "bench.py")).read())
    out = tmp_path / "check.json"
    proc = launch_forked(["--loader-check", *TINY, "--workers", 1, "--loader", "torch", "--batch-size", 32,
                          "--device", "cpu", "--data-dir", pngs, "--steps", 6, "--warmup", 2, "--json", out],
                         nproc=2, script=str(code / "bench.py"), env=ADAPTED_ENV)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("loader check: ")]
    assert re.fullmatch(rf"loader check: 1 DataLoader worker per rank read ImageFolderSplit of {pngs}/train "
                        r"\(on \S+\), 16 images per rank and step, 6 steps after 2 untimed", lines[0]), lines
    check = read_json(out)["loader_check"]
    rates, step_s = check["images_per_s_per_rank"], check["step_s"]
    assert len(rates) == 2 and all(rate > 0 for rate in rates)
    assert lines[1].endswith(f", {sum(rates):.0f} img/s in all") and f", {min(rates):.0f}), " in lines[1]
    assert lines[2].startswith(f"loader check: the step consumes {16 / step_s:.0f} img/s per rank, ")
    # what the figures make: a batch read in load_s on the slowest rank, read ahead by the worker while a step runs
    load_s = 16 / min(rates)
    wait = max(0.0, load_s - step_s) / max(load_s, step_s)
    if wait <= 0.05:
        assert lines[3] == f"loader check: it keeps up: the slowest rank's loader delivers {step_s / load_s:.2f}x " \
                           "what its step consumes" and check["fixes"] == []
    else:
        fixes = name_fixes(device_loader=False, workers=1, cpus=check["cpus_per_rank"], in_memory=False,
                           data_dir=str(pngs), fs=check["file_system"])
        assert lines[3] == (f"loader check: it falls short: the slowest rank's loader delivers {step_s / load_s:.2f}x "
                            f"what its step consumes, so each step would wait for data {wait * 100:.0f}% of its time; "
                            f"the fixes: {'; '.join(fixes)}") and check["fixes"] == fixes
    assert len(lines) == 4


def test_preflight_passes_and_reports_every_rank(tmp_path):
    proc = launch(["--dataset", "synthetic", "--out-dir", tmp_path / "out", "--device", "cpu"], nproc=2,
                  script="preflight.py")
    out = proc.stdout
    assert "backend gloo; torch" in out and "world size 2" in out
    rows = re.findall(r"^ +(\d) +(\d) +\S+ +cpu .* ok$", out, re.M)
    assert rows == [("0", "0"), ("1", "1")]
    assert re.search(r"^all_reduce bus bandwidth: 1 MiB [\d.]+ GB/s, 4 MiB [\d.]+ GB/s, 16 MiB [\d.]+ GB/s$",
                     out, re.M)
    assert out.strip().endswith("preflight: all checks passed")


def test_preflight_fails_when_a_node_lacks_the_data(tmp_path):
    empty = tmp_path / "nodata"
    empty.mkdir()
    proc = launch(["--data-dir", empty, "--out-dir", tmp_path / "out", "--device", "cpu"], nproc=2,
                  script="preflight.py", check=False)
    assert proc.returncode == 1
    assert "FAILED: rank 0 on" in proc.stderr and f"neither {empty}/cifar-100-python/ nor" in proc.stderr
    assert "all checks passed" not in proc.stdout


def test_bench_comm_hooks_counts_each_hooks_bytes_and_preflight_predicts_the_scaling_from_them(tmp_path):
    """bench.py --comm-hooks on 2 ranks: per step, none all-reduces every fp32 gradient once, fp16 and bf16 half of
    that, PowerSGD (compressing from step 3) a small share in more all-reduces. preflight.py --bench reads it and
    predicts a scaling efficiency per hook at its own size; a file without that result is one line."""
    path = tmp_path / "hooks.json"
    proc = launch(["--comm-hooks", "--depth", 10, "--widen-factor", 1, "--batch-size", 64, "--steps", 3,
                   "--warmup", 3, "--device", "cpu", "--train-size", 1024, "--json", path], nproc=2,
                  script="bench.py")
    result = read_json(path)["comm_hooks"]
    rows, gradients = result["rows"], result["gradient_bytes"]
    assert list(rows) == ["none", "fp16", "bf16", "powersgd"]
    from model import WideResNet
    assert gradients == 4 * sum(p.numel() for p in WideResNet(10, 1, num_classes=100).parameters())  # fp32
    assert rows["none"]["bytes_per_step"] == gradients
    assert rows["fp16"]["bytes_per_step"] == rows["bf16"]["bytes_per_step"] == gradients / 2
    assert rows["powersgd"]["bytes_per_step"] < 0.2 * gradients
    assert rows["powersgd"]["all_reduces_per_step"] > rows["none"]["all_reduces_per_step"]
    assert result["compute_s"] > 0 and all(r["step_s"] > 0 and r["comm_s"] >= 0 for r in rows.values())
    assert re.search(r"^comm hook fp16: [\d.]+ MiB per step \(0\.500x none's\) in 1 all-reduces; step ",
                     proc.stdout, re.M)

    pre = launch(["--dataset", "synthetic", "--out-dir", tmp_path / "out", "--device", "cpu", "--bench", path],
                 nproc=2, script="preflight.py")
    assert re.search(r"^predicted scaling at 2 ranks: a step of [\d.]+ ms without all-reduce \(bench.py "
                     r"--comm-hooks on 2 ranks\), all-reduced at [\d.]+ GB/s \(the 16 MiB messages'\)", pre.stdout,
                     re.M)
    for hook in rows:
        assert re.search(rf"^  --comm-hook {hook}: [\d.]+ MiB per step, all-reduce [\d.]+ ms: \d+% - \d+%$",
                         pre.stdout, re.M), pre.stdout
    (tmp_path / "other.json").write_text("{}")
    refused = launch(["--bench", tmp_path / "other.json", "--device", "cpu"], torchrun=False,
                     script="preflight.py", check=False)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"error: --bench {tmp_path}/other.json: it holds no comm_hooks result; make one with torchrun "
        f"--nproc_per_node=2 bench.py --comm-hooks --json {tmp_path}/other.json (on the job's GPUs, with its "
        f"per-GPU batch)")
