"""The GPU checklist: all the device work, in one call of at most 8 minutes on one H100 or H200, in order of value,
so that a call cut short still leaves the first results:

  1. tests      pytest tests/gpu: every CUDA-only path (tests/gpu/test_gpu.py's docstring lists them)
  2. bench      bench.py --compile --compare-original: the step, MFU and peak memory, against the original's pipeline
  3. candidates bench.py --candidates: compile modes, twice the batch, the optimizer step compiled, each as a ratio
                to today's default, side by side in one process; the evaluation's cost per epoch; and --deterministic
                (a process of its own: cuBLAS's setting comes before CUDA starts), as a ratio to the same default
  4. fashion    WRN-16-8 on all of Fashion-MNIST (60,000 / 10,000), bf16, compiled: the training seconds until the
                test accuracy first reaches 95% (metrics.jsonl's train_time_s), and the final accuracy
  5. exactness  on 1 GPU, with and without --deterministic: two identical runs, and a run stopped mid-epoch and
                resumed, each against an uninterrupted run, tensor for tensor; with 2 GPUs also 1 GPU x 2
                micro-steps against 2 GPUs x 1

Each step runs under a time cap (its own, and what is left of --budget), its processes killed at the cap, and
writes its log and JSON into the results folder; summary.json and summary.md (the rows for
bench-results/README.md) are rewritten after every step. With $OUT set (the device tool), the folder is also packed
into $OUT/results.tar.gz beside $OUT/summary.md and $OUT/summary.json after every step.

    python3 bench-results/gpu_checklist.py                       # on a GPU machine, from the project directory
    python3 bench-results/gpu_checklist.py --dry-run             # every step end to end on this CPU, tiny (CI)
    python3 bench-results/gpu_checklist.py --steps fashion,exactness --budget 300

Fashion-MNIST's four gzipped idx files: --fashion-dir, else datasets/fashion-mnist/ (git-ignored: copy them there to
carry them to a machine without a network), else /usr/share/datasets/fashion-mnist/ (Debian's dataset-fashion-mnist).
"""
import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["tests", "bench", "candidates", "fashion", "exactness"]
# Each step's cap in seconds on a GPU, about twice what it is expected to take (the total: --budget).
CAPS = {"tests": 180, "bench": 75, "candidates": 150, "deterministic": 45, "fashion": 180, "exactness": 90}
FASHION_DIRS = [os.path.join(ROOT, "datasets", "fashion-mnist"), "/usr/share/datasets/fashion-mnist"]
# The tests the dry run runs (in-process, no launch): the plumbing of step 1, not the CUDA paths.
DRY_TESTS = "device_loader_on_the_gpu_matches or pins_memory"
# WRN-16-8 on Fashion-MNIST: the WRN paper's recipe (Nesterov, weight decay 5e-4, LR 0.1 per 128, crop and
# flip) at batch 512, shortened: cosine over the epochs after 2 of warm-up. --target-accuracy: the time to 95%.
FASHION = ["--recipe", "wrn-paper", "--lr-schedule", "cosine", "--warmup-epochs", "2", "--target-accuracy", "0.95",
           "--patience", "0", "--log-every", "0"]
FASHION_EPOCHS = 40  # unless step 2's img/s says how many fit in about 2 minutes (fashion_epochs)
# The exactness runs: synthetic data, 4 steps an epoch, one run stopped after step 2 of epoch 1 (the stop file is
# seen at the first check: --checkpoint-every 2 makes step 2 one). One thread per process, as torchrun gives each of
# several: the CPU's sums (the loader's, and everything in a dry run) then add up in one order in every run.
EXACT = ["--dataset", "synthetic", "--train-size", "1024", "--test-size", "256", "--batch-size", "256",
         "--epochs", "2", "--log-every", "0", "--workers", "0", "--loader", "gpu"]
DRY_EXACT = {"--train-size": "512", "--test-size": "128", "--batch-size": "128", "--epochs": "1"}


class Checklist:
    def __init__(self, args):
        self.args, self.dry = args, args.dry_run
        self.python = args.python or sys.executable
        self.torchrun = [self.python, "-m", "torch.distributed.run", "--standalone"]
        self.results, self.started = {}, time.monotonic()
        self.device = self.query("import torch; print(torch.cuda.get_device_name(0) "
                                 "if torch.cuda.is_available() else 'cpu')")
        if self.device == "cpu" and not self.dry:
            sys.exit("error: no CUDA GPU visible: this checklist needs one (or run --dry-run on a CPU)")
        self.gpus = 2 if self.dry else int(self.query("import torch; print(torch.cuda.device_count())"))
        self.torch = self.query("import torch; print(torch.__version__)")
        slug = re.sub(r"[^a-z0-9]+", "-", self.device.lower().removeprefix("nvidia ")).strip("-")
        self.tag = f"{slug}-{datetime.date.today().isoformat()}"
        self.dir = os.path.abspath(args.results or os.path.join(ROOT, "runs", "gpu-checklist", self.tag))
        shutil.rmtree(self.dir, ignore_errors=True)  # a leftover checkpoint would be resumed and train nothing
        os.makedirs(self.dir)
        self.meta = {"device": self.device, "gpus": self.gpus, "torch": self.torch, "dry_run": self.dry,
                     "commit": args.commit or git_commit(), "date": datetime.date.today().isoformat(),
                     "results": self.dir}
        print(f"=== {self.device} x {self.gpus}, torch {self.torch}, commit {self.meta['commit']}"
              f"{' (dry run)' if self.dry else ''}; results in {self.dir}", flush=True)

    def query(self, code: str) -> str:
        return subprocess.run([self.python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    # ------------------------------------------------------------------ running a command under a cap

    def run(self, name: str, cmd: list, cap: float, env=None, first=signal.SIGTERM) -> dict:
        """`cmd` with its output in <name>.log, stopped (its whole process group) at min(cap, the budget left): by
        `first` (SIGTERM: a training run checkpoints and leaves; SIGINT: pytest writes its report), then SIGKILL."""
        limit = max(0.0, min(cap, self.left()))
        log_path = os.path.join(self.dir, f"{name}.log")
        if limit < 5:
            return {"status": "skipped: the budget is spent", "seconds": 0.0, "log": log_path}
        print(f"--- {name}: {shlex.join(map(str, cmd))}  (cap {limit:.0f} s)", flush=True)
        start = time.monotonic()
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(map(str, cmd))}\n")
            log.flush()
            proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else f"failed (exit status {rc})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, first)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                status = f"timed out after {limit:.0f} s"
        seconds = time.monotonic() - start
        print(f"    {status} in {seconds:.0f} s", flush=True)
        return {"status": status, "seconds": round(seconds, 1), "log": log_path}

    def train(self, name: str, flags: list, nproc: int, cap: float, script="train_ddp.py", env=None) -> dict:
        cmd = [*self.torchrun, f"--nproc_per_node={nproc}", script, *flags]
        return self.run(name, cmd, cap, env=env)

    def cap(self, step: str) -> float:
        return CAPS[step] * (4 if self.dry else 1)  # a dry run on 2 CPU cores is slower, and only checks plumbing

    def device_flags(self) -> list:
        return ["--device", "cpu", "--amp", "off"] if self.dry else []

    # ------------------------------------------------------------------ the steps

    def step_tests(self) -> dict:
        xdist = self.query("import importlib.util as u; print(bool(u.find_spec('xdist')))") == "True"
        # its three files side by side, each whole in one worker (their module fixtures run once)
        workers = ["-n", str(max(1, min(3, (os.cpu_count() or 2) // 2))), "--dist", "loadfile"] if xdist else []
        junit = os.path.join(self.dir, "tests.xml")
        cmd = [self.python, "-m", "pytest", "tests/gpu", "-o", "addopts=", "-ra", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *([] if self.dry else workers)]
        if self.dry:
            cmd += ["-k", DRY_TESTS]
        result = self.run("tests", cmd, self.cap("tests"), env={"GPU_TESTS_ON_CPU": "1"} if self.dry else None,
                          first=signal.SIGINT)  # cut short: pytest still writes tests.xml
        if os.path.exists(junit):
            text = open(junit).read()
            counts = re.search(r'<testsuite [^>]*errors="(\d+)" failures="(\d+)" skipped="(\d+)" tests="(\d+)"',
                               text)
            if counts:
                errors, failures, skipped, tests = map(int, counts.groups())
                result.update(tests=tests, passed=tests - errors - failures - skipped, failed=failures + errors,
                              skipped=skipped,
                              failed_names=re.findall(r'<testcase [^>]*name="([^"]+)"[^>]*>\s*<(?:failure|error)',
                                                      text))
        return result

    def bench_flags(self) -> list:
        if self.dry:
            return ["--depth", "10", "--widen-factor", "1", "--batch-size", "32", "--steps", "1", "--warmup", "1",
                    "--train-size", "64", "--workers", "1", "--compile-backend", "eager", *self.device_flags()]
        return []

    def step_bench(self) -> dict:
        path = os.path.join(self.dir, "bench.json")
        result = self.train("bench", ["--compile", "--compare-original", *self.bench_flags(), "--json", path], 1,
                            self.cap("bench"), script="bench.py")
        if os.path.exists(path):
            bench = json.load(open(path))
            ours = bench["ours"]
            result.update(images_per_s=ours["images_per_s"], step_ms=ours["step_s"] * 1e3, mfu=ours.get("mfu"),
                          peak_memory_gib=ours.get("peak_memory_gib"), speedup=bench.get("speedup_vs_original"),
                          original_images_per_s=bench.get("original", {}).get("images_per_s"), json=path)
        return result

    def step_candidates(self) -> dict:
        path = os.path.join(self.dir, "candidates.json")
        flags = ["--compile", *self.bench_flags()]
        result = self.train("candidates", [*flags, "--candidates", "--json", path], 1, self.cap("candidates"),
                            script="bench.py")
        rows = json.load(open(path))["candidates"] if os.path.exists(path) else {}
        det_path = os.path.join(self.dir, "deterministic.json")
        result["deterministic_run"] = self.train("deterministic", [*flags, "--deterministic", "--json", det_path], 1,
                                                 self.cap("deterministic"), script="bench.py")
        result["rows"] = {name: {"images_per_s": r["images_per_s"], "ratio": r["ratio"], "warmup_s": r["warmup_s"]}
                          for name, r in rows.get("rows", {}).items()}
        if rows.get("evaluation"):
            result["evaluation"] = rows["evaluation"]
        default = [r["images_per_s"] for name, r in result["rows"].items() if name.startswith("default")]
        if os.path.exists(det_path) and default:
            ips = json.load(open(det_path))["ours"]["images_per_s"]
            result["rows"]["--deterministic (own process)"] = {"images_per_s": ips,
                                                               "ratio": ips / (sum(default) / len(default))}
        result["json"] = [p for p in (path, det_path) if os.path.exists(p)]
        return result

    def fashion_dir(self):
        for d in ([self.args.fashion_dir] if self.args.fashion_dir else FASHION_DIRS):
            if os.path.exists(os.path.join(d, "t10k-labels-idx1-ubyte.gz")):
                return d
        return None

    def fashion_epochs(self) -> int:
        """--fashion-epochs, else as many as about 2 minutes of training take at step 2's rate (Fashion-MNIST's
        images have 0.77 of CIFAR's pixels; an epoch: 60,000 images, then 10,000 scored), 10 to 60; else 40."""
        ips = self.results.get("bench", {}).get("images_per_s")
        if self.args.fashion_epochs or not ips:
            return self.args.fashion_epochs or FASHION_EPOCHS
        return max(10, min(60, int(120 * ips / 0.77 / 70_000)))

    def step_fashion(self) -> dict:
        data_dir = self.fashion_dir()
        if data_dir is None:
            return {"status": f"skipped: no Fashion-MNIST in {self.args.fashion_dir or ' or '.join(FASHION_DIRS)}"}
        script = write_fashion_script(self.dir)
        out = os.path.join(self.dir, "fashion-run")
        if self.dry:
            flags = [*FASHION, "--depth", "10", "--widen-factor", "1", "--batch-size", "64", "--epochs", "1",
                     "--train-size", "256", "--test-size", "128", "--workers", "0", *self.device_flags()]
        else:
            flags = [*FASHION, "--epochs", str(self.fashion_epochs()), "--compile", "--amp", "bf16"]
        result = self.train("fashion", [*flags, "--data-dir", data_dir, "--out-dir", out], 1, self.cap("fashion"),
                            script=script, env={"PYTHONPATH": ROOT})
        metrics_path = os.path.join(out, "metrics.jsonl")
        if os.path.exists(metrics_path):
            shutil.copy(metrics_path, os.path.join(self.dir, "fashion-metrics.jsonl"))
            rows = [json.loads(line) for line in open(metrics_path)]
            reached = next((m for m in rows if m["val_acc"] >= 0.95), None)
            result.update(epochs=len(rows), final_acc=rows[-1]["val_acc"] if rows else None,
                          best_acc=max((m["val_acc"] for m in rows), default=None),
                          train_s=rows[-1]["train_time_s"] if rows else None,
                          run_s=rows[-1]["run_time_s"] if rows else None,
                          first_epoch_s=rows[0]["epoch_time_s"] if rows else None,
                          images_per_s_after_first=(sum(m["images_per_s"] for m in rows[1:]) / (len(rows) - 1)
                                                    if len(rows) > 1 else None),
                          epoch_at_95=reached and reached["epoch"], train_s_to_95=reached and reached["train_time_s"],
                          run_s_to_95=reached and reached["run_time_s"], command=flags)
        shutil.rmtree(out, ignore_errors=True)  # checkpoints: not results
        return result

    def step_exactness(self) -> dict:
        """Tensor for tensor, the checkpoints' weights and buffers: a repeat of the uninterrupted run, a run stopped
        mid-epoch and resumed, and (2 GPUs) 1 x 2 micro-steps against 2 x 1, each against the uninterrupted run."""
        model = ["--depth", "10", "--widen-factor", "1" if self.dry else "2", *self.device_flags()]
        exact = list(EXACT)
        for flag, value in (DRY_EXACT.items() if self.dry else ()):
            exact[exact.index(flag) + 1] = value
        result, cap = {}, CAPS["exactness"] / 2 * (4 if self.dry else 1)  # one run's cap
        # a dry run: --deterministic's alone (the same steps; CI's minutes are few)
        modes = [("deterministic", ["--deterministic"])] + ([] if self.dry else [("default", [])])  # the claim first
        for mode, extra in modes:
            flags, base, runs = [*exact, *model, *extra], os.path.join(self.dir, "exact", mode), {}
            os.makedirs(base, exist_ok=True)

            def train(name, more=(), nproc=1, env=None, out_dir=None):
                out, env = ["--out-dir", os.path.join(base, out_dir or name)], {"OMP_NUM_THREADS": "1", **(env or {})}
                runs[name] = self.train(f"exact-{mode}-{name}", [*flags, *more, *out], nproc, cap, env=env)["status"]
            train("uninterrupted")
            if mode == "default":  # two identical runs: what the default kernels leave of "the same"
                train("repeat")
            stop_file = os.path.join(base, "stop")
            open(stop_file, "w").close()  # seen at the first check: step 2 of epoch 1
            train("stopped", ["--checkpoint-every", "2"], env={"DDP_STOP_FILE": stop_file})  # exits to be resumed
            os.remove(stop_file)
            stopped = stopped_at(base)  # a comparison of a run that never stopped would prove nothing
            if stopped is None:
                train("resumed", out_dir="stopped")
            comparisons = {"repeat": compare(base, "repeat")} if "repeat" in runs else {}
            comparisons["resumed mid-epoch"] = compare(base, "stopped") if stopped is None else {"error": stopped}
            if self.gpus >= 2:
                train("accumulation", ["--micro-batch", str(int(exact[exact.index("--batch-size") + 1]) // 2)])
                train("two", nproc=2)
                comparisons["1 x 2 micro-steps against 2 x 1"] = compare(base, "accumulation", against="two")
            result[mode] = {"runs": runs, "comparisons": comparisons}
            for name, c in comparisons.items():
                print(f"    {mode}: {name}: {describe(c)}", flush=True)
        if self.gpus < 2:
            result["note"] = "one GPU: 1 x 2 micro-steps against 2 processes needs 2 (NCCL refuses a shared GPU)"
        shutil.rmtree(os.path.join(self.dir, "exact"), ignore_errors=True)
        done = all(c for m, _ in modes for c in result[m]["comparisons"].values())
        return {"status": "ok" if done else "incomplete: a run failed (its log says why)", **result}

    # ------------------------------------------------------------------ the summary

    def save(self) -> None:
        summary = {**self.meta, "budget_s": self.args.budget, "seconds": round(time.monotonic() - self.started, 1),
                   "steps": self.results}
        with open(os.path.join(self.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        with open(os.path.join(self.dir, "summary.md"), "w") as f:
            f.write(render(summary))
        out = os.environ.get("OUT")
        if out:  # the device tool brings back at most 8 files: the two summaries and one archive of the rest
            for name in ("summary.json", "summary.md"):
                shutil.copy(os.path.join(self.dir, name), os.path.join(out, name))
            with tarfile.open(os.path.join(out, "results.tar.gz"), "w:gz") as tar:
                tar.add(self.dir, arcname=self.tag)


def git_commit() -> str:
    """HEAD's short hash, or "unknown" where the copy has no .git (a device machine's copy of the tree: --commit)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:  # no git
        return "unknown"


def write_fashion_script(folder: str) -> str:
    """train_ddp.py with load_data replaced by the README's Fashion-MNIST block (as the tests do), in `folder`."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    after = readme.split("<!-- worked example: the tests replace load_data with exactly this block -->", 1)[1]
    block = after.split("```python\n", 1)[1].split("```", 1)[0]
    src = open(os.path.join(ROOT, "train_ddp.py")).read()
    start = src.index("\ndef load_data(") + 1
    end = re.compile(r"^\S", re.M).search(src, src.index("\n", start) + 1).start()  # the next top-level line
    path = os.path.join(folder, "train_fashion.py")
    with open(path, "w") as f:
        f.write(src[:start] + block.strip("\n") + "\n\n\n" + src[end:])
    return path


def stopped_at(base: str) -> str | None:
    """None if the run in base/stopped stopped mid-epoch as asked (its checkpoint at epoch 0, past its first sample),
    else why not."""
    import torch
    path = os.path.join(base, "stopped", "checkpoint.pt")
    if not os.path.exists(path):
        return "the stopped run left no checkpoint"
    progress = torch.load(path, map_location="cpu", weights_only=True)["progress"]
    if progress["epoch"] != 0 or progress["position"] == 0:
        return f"the run did not stop mid-epoch 1 (epoch {progress['epoch']} done, position {progress['position']})"
    return None


def compare(base: str, name: str, against: str = "uninterrupted") -> dict | None:
    """The checkpoints' model tensors (weights and BatchNorm buffers) of run `name` against run `against`: how many
    are equal bit for bit, and the largest difference. None if either run left no checkpoint."""
    import torch
    paths = [os.path.join(base, n, "checkpoint.pt") for n in (name, against)]
    if not all(os.path.exists(p) for p in paths):
        return None
    a, b = (torch.load(p, map_location="cpu", weights_only=True) for p in paths)
    if a["progress"]["epoch"] != b["progress"]["epoch"]:
        return {"error": f"{name} ended at epoch {a['progress']['epoch']}, {against} at {b['progress']['epoch']}"}
    tensors = [(a["model"][k], b["model"][k]) for k in b["model"]]
    equal = sum(torch.equal(x, y) for x, y in tensors)
    diff = max(((x.double() - y.double()).abs().max().item() for x, y in tensors if x.is_floating_point()),
               default=0.0)
    return {"equal": equal, "tensors": len(tensors), "max_abs_diff": diff}


def describe(c) -> str:
    if not c:
        return "not run"
    if "error" in c:
        return c["error"]
    return (f"{c['equal']} of {c['tensors']} tensors bit for bit" +
            (f", the largest difference {c['max_abs_diff']:.3g}" if c["equal"] < c["tensors"] else ""))


def render(summary: dict) -> str:
    """summary.md: what each step gave, as rows for bench-results/README.md."""
    s, lines = summary["steps"], []
    where = f"{summary['device']}, torch {summary['torch']}, commit {summary['commit']}"
    lines.append(f"# GPU checklist, {summary['date']}: {where}{' (DRY RUN on a CPU)' if summary['dry_run'] else ''}")
    lines.append(f"\n{summary['seconds']:.0f} s of a {summary['budget_s']:.0f} s budget; results: "
                 f"{summary['results']}\n")
    lines.append("| step | status | seconds |\n|---|---|---|")
    lines += [f"| {name} | {r.get('status')} | {r.get('seconds', '')} |" for name, r in s.items()]
    if "tests" in s and "tests" in s["tests"]:
        t = s["tests"]
        lines.append(f"\n**GPU tests**: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped of "
                     f"{t['tests']}" + (f"; failed: {', '.join(t['failed_names'])}" if t["failed_names"] else ""))
    b = s.get("bench", {})
    if "images_per_s" in b:
        mfu = "n/a" if b["mfu"] is None else f"{b['mfu'] * 100:.1f}%"
        ratio = "n/a" if not b.get("speedup") else f"{b['speedup']:.2f}x"
        lines.append(f"\n**Step benchmark**: {b['images_per_s']:,.0f} img/s, step {b['step_ms']:.1f} ms, MFU {mfu}, "
                     f"peak {b['peak_memory_gib'] or 0:.1f} GiB; the original's pipeline "
                     f"{b['original_images_per_s'] or 0:,.0f} img/s: {ratio}")
    c = s.get("candidates", {})
    if c.get("rows"):
        lines.append("\n**Speed candidates** (img/s; ratio to the default, the mean of its two rows):\n")
        lines.append("| candidate | img/s | ratio | warm-up s |\n|---|---|---|---|")
        lines += [f"| {n} | {r['images_per_s']:,.0f} | {r['ratio']:.3f} | {r.get('warmup_s', 0):.1f} |"
                  for n, r in c["rows"].items()]
        if c.get("evaluation"):
            e = c["evaluation"]
            lines.append(f"\nEvaluation: {e['images']} test images in {e['eval_s']:.3f} s, "
                         f"{e['share'] * 100:.1f}% of an epoch of 50,000 with it")
    f = s.get("fashion", {})
    if "epochs" in f:
        to95 = (f"epoch {f['epoch_at_95']}, **{f['train_s_to_95']:.1f} s** of training ({f['run_s_to_95']:.1f} s "
                f"with evaluation)" if f["epoch_at_95"] else "not reached")
        epochs = f"{f['epochs']} epoch{'s' if f['epochs'] > 1 else ''}"
        lines.append(f"\n**Fashion-MNIST** ({epochs}): to 95%: {to95}; final **{f['final_acc'] * 100:.2f}%**"
                     f" (best {f['best_acc'] * 100:.2f}%) after {f['train_s']:.0f} s of training, {f['run_s']:.0f} s "
                     f"with evaluation; first epoch {f['first_epoch_s']:.1f} s"
                     + (f"; {f['images_per_s_after_first']:,.0f} img/s after it" if f["images_per_s_after_first"]
                        else ""))
    x = s.get("exactness", {})
    for mode in ("deterministic", "default"):
        if mode in x:
            lines.append(f"\n**Exactness, {mode}**: " + "; ".join(f"{n}: {describe(cmp)}"
                                                               for n, cmp in x[mode]["comparisons"].items()))
    if x.get("note"):
        lines.append(f"({x['note']})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dry-run", action="store_true", help="every step end to end on this CPU, tiny configurations")
    p.add_argument("--steps", default=",".join(STEPS), help=f"which steps, in this order: {','.join(STEPS)}")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all the steps, each also under its cap (default: 480; a dry run 1800)")
    p.add_argument("--fashion-dir", default=None, help="Fashion-MNIST's four .gz files (default: see below)")
    p.add_argument("--fashion-epochs", type=int, default=0,
                   help=f"epochs of the Fashion-MNIST run (default: what 2 minutes fit at step 2's rate, else "
                   f"{FASHION_EPOCHS})")
    p.add_argument("--results", default=None, help="the results folder (default: runs/gpu-checklist/<gpu>-<date>)")
    p.add_argument("--python", default=None, help="the Python with torch (default: this one)")
    p.add_argument("--commit", default=None, help="the commit the results are of (default: git's HEAD)")
    args = p.parse_args(argv)
    args.budget = args.budget or (1800 if args.dry_run else 480)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; the steps: {', '.join(STEPS)}")
    checklist = Checklist(args)
    for step in STEPS:
        if step in steps:
            print(f"\n=== {datetime.datetime.now().isoformat(timespec='seconds')} {step} "
                  f"({checklist.left():.0f} s of the budget left)", flush=True)
            try:
                checklist.results[step] = getattr(checklist, f"step_{step}")()
            except Exception as e:  # a step's own error: said, and the next step still runs
                checklist.results[step] = {"status": f"error: {type(e).__name__}: {e}"}
            checklist.save()
    print("\n" + render({**checklist.meta, "budget_s": args.budget, "seconds": time.monotonic() - checklist.started,
                         "steps": checklist.results}), flush=True)
    return 0 if all(r.get("status") == "ok" for r in checklist.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
