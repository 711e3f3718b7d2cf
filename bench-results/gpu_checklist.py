"""The GPU checklist: all the device work, in one command of at most 9 minutes on one H100 or H200, in order of value,
so that a command cut short at any moment still leaves every result obtained before the cut:

  0. probe      torch and CUDA versions, the device's name, compute mode and free memory, /dev/shm's free space
  1. bench      bench.py --compile: the step's img/s and MFU (its JSON written as soon as the img/s exists)
  2. tests      pytest tests/gpu, on enough workers to fit its cap: every CUDA-only path, and how many were expected
  3. fashion    WRN-16-8 on all of Fashion-MNIST (60,000 / 10,000) at batch 500 (one training and one test graph),
                bf16, compiled, FASHION_EPOCHS epochs, its out-dir in /dev/shm: the training seconds until the test
                accuracy first reaches 95%, as measured and without the first epoch's compile; the final accuracy
  4. exactness  on 1 GPU, with --deterministic, then without: a run stopped mid-epoch and resumed against an
                uninterrupted run, tensor for tensor (without: also a repeat); with 2 GPUs also 1 GPU x 2 micro-steps
                against 2 x 1
  5. candidates bench.py --candidates: compile modes, twice the batch, the optimizer step compiled, each as a ratio to
                today's default, side by side in one process, with whether CUDA graphs ran; the evaluation's cost

Each step runs under its cap (CAPS; the last step gets what is left of the budget), its processes stopped before the
cap (pytest by SIGINT, so that its report is written; a run by SIGTERM, so that it checkpoints), and KILL_GRACE later
killed. The caps add up to the default budget, 480 s: with the probe and the packing the command ends within about
500 s, inside the device tool's 600 s a command. summary.json and summary.md (the rows for bench-results/README.md)
are rewritten before and after every step, and within a step as its parts finish: every planned step is listed as
ok, failed, cut (at its cap, by the budget, or with the checklist), skipped, not reached, or error. With $OUT set
(the device tool), the results folder is also packed into $OUT/results.tar.gz beside $OUT/summary.md and
$OUT/summary.json each time. SIGTERM or Ctrl-C to the checklist: the running step is stopped and said to be cut, the
summaries are written, and it exits 143 (130).

    python3 bench-results/gpu_checklist.py --commit <hash>        # on a GPU machine, from the project directory
    python3 bench-results/gpu_checklist.py --dry-run             # every step end to end on this CPU, tiny (CI)
    python3 bench-results/gpu_checklist.py --steps fashion,exactness --budget 300

Fashion-MNIST's four gzipped idx files: --fashion-dir, else datasets/fashion-mnist/ (git-ignored: copy them there and
carry it to the GPU machine, which has no network), else /usr/share/datasets/fashion-mnist/ (Debian's
dataset-fashion-mnist). Without them the first lines say so, and the other steps run.
"""
import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["bench", "tests", "fashion", "exactness", "candidates"]  # in order of value
# Each step's cap in seconds on a GPU; they add up to DEFAULT_BUDGET. The last step run gets what is left.
CAPS = {"bench": 70, "tests": 130, "fashion": 140, "exactness": 80, "candidates": 60}
DEFAULT_BUDGET = 480
KILL_GRACE = 15  # seconds from the first signal (a run checkpoints, pytest writes its report) to SIGKILL
FASHION_DIRS = [os.path.join(ROOT, "datasets", "fashion-mnist"), "/usr/share/datasets/fashion-mnist"]
# The tests the dry run runs (in-process, no launch): the plumbing of step 2, not the CUDA paths.
DRY_TESTS = "device_loader_on_the_gpu_matches or pins_memory"
# WRN-16-8 on Fashion-MNIST: the WRN paper's recipe (Nesterov, weight decay 5e-4, LR 0.1 per 128, crop and
# flip), shortened: cosine over the epochs after 2 of warm-up. --target-accuracy: the time to 95% in the records.
# Batch 500 divides both splits (60,000 = 120 x 500, 10,000 = 20 x 500): no short last batch, so --compile makes
# one training graph and one test graph (a short batch would add one of each).
FASHION = ["--recipe", "wrn-paper", "--lr-schedule", "cosine", "--warmup-epochs", "2", "--target-accuracy", "0.95",
           "--patience", "0", "--log-every", "0", "--batch-size", "500"]
FASHION_EPOCHS = 30  # at about 1.5 s an epoch on an H100 or H200 after a compile of about a minute: within its cap
FASHION_TRAIN_IMAGES = 60_000
# The exactness runs: synthetic data, 4 steps an epoch, one run stopped after step 2 of epoch 1 (the stop file is
# seen at the first check: --checkpoint-every 2 makes step 2 one). One thread per process, as torchrun gives each of
# several: the CPU's sums (the loader's, and everything in a dry run) then add up in one order in every run.
EXACT = ["--dataset", "synthetic", "--train-size", "1024", "--test-size", "256", "--batch-size", "256",
         "--epochs", "2", "--log-every", "0", "--workers", "0", "--loader", "gpu"]
DRY_EXACT = {"--train-size": "512", "--test-size": "128", "--batch-size": "128", "--epochs": "1"}
PROBE = r"""
import json, shutil, subprocess, torch
cuda = torch.cuda.is_available()
p = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
     "device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": torch.cuda.device_count() if cuda else 0}
if cuda:
    free, total = torch.cuda.mem_get_info(0)
    p.update(free_memory_gib=round(free / 2**30, 1), total_memory_gib=round(total / 2**30, 1),
             capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.splitlines()[0].split(", ")
        p.update(compute_mode=smi[0], driver=smi[1])
    except Exception as e:
        p["compute_mode"] = f"unknown (nvidia-smi: {type(e).__name__})"
try:
    p["dev_shm_free_gib"] = round(shutil.disk_usage("/dev/shm").free / 2**30, 1)
except OSError:
    p["dev_shm_free_gib"] = None
print(json.dumps(p))
"""


class Cut(BaseException):
    """SIGTERM or SIGINT to the checklist itself: the running step is stopped, and the summaries written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Checklist:
    def __init__(self, args, steps):
        self.args, self.dry, self.planned = args, args.dry_run, steps
        self.python = args.python or sys.executable
        self.torchrun = [self.python, "-m", "torch.distributed.run", "--standalone"]
        self.started = time.monotonic()
        self.probe = json.loads(self.query(PROBE))
        self.device = self.probe["device"]
        if self.device == "cpu" and not self.dry:
            sys.exit("error: no CUDA GPU visible: this checklist needs one (or run --dry-run on a CPU)")
        self.gpus = 2 if self.dry else self.probe["gpus"]
        slug = re.sub(r"[^a-z0-9]+", "-", self.device.lower().removeprefix("nvidia ")).strip("-")
        self.tag = f"{slug}-{datetime.date.today().isoformat()}"
        self.dir = os.path.abspath(args.results or os.path.join(ROOT, "runs", "gpu-checklist", self.tag))
        shutil.rmtree(self.dir, ignore_errors=True)  # a leftover checkpoint would be resumed and train nothing
        os.makedirs(self.dir)
        self.meta = {"device": self.device, "gpus": self.gpus, "torch": self.probe["torch"], "dry_run": self.dry,
                     "commit": args.commit or git_commit(), "date": datetime.date.today().isoformat(),
                     "results": self.dir, "probe": self.probe,
                     "plan": {s: ("the rest of the budget" if s == steps[-1] else self.cap(s)) for s in steps}}
        self.results = {s: {"state": "not reached", "status": "not reached: the checklist ended before it"}
                        for s in steps}
        print(f"=== {self.device} x {self.gpus}, torch {self.probe['torch']} (CUDA {self.probe['cuda']}), commit "
              f"{self.meta['commit']}{' (dry run)' if self.dry else ''}; results in {self.dir}", flush=True)
        print(f"=== probe: {json.dumps(self.probe)}", flush=True)
        if "fashion" in steps and self.fashion_dir() is None:
            why = (f"no Fashion-MNIST in {self.args.fashion_dir or ' or '.join(FASHION_DIRS)}: the fashion step is "
                   f"skipped (copy the four .gz files into datasets/fashion-mnist and carry that folder)")
            print(f"=== note: {why}", flush=True)
            self.results["fashion"] = {"state": "skipped", "status": f"skipped: {why}"}
        self.save()

    def query(self, code: str) -> str:
        return subprocess.run([self.python, "-c", code], capture_output=True, text=True, check=True,
                              timeout=120).stdout.strip()

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def cap(self, step: str) -> float:
        return CAPS[step] * (4 if self.dry else 1)  # a dry run on 2 CPU cores is slower, and only checks plumbing

    def limit(self, step: str) -> float:
        """The step's time: its cap and what is left of the budget; the last step planned, all that is left."""
        return max(0.0, self.left() if step == self.planned[-1] else min(self.cap(step), self.left()))

    # ------------------------------------------------------------------ running a command under a cap

    def run(self, name: str, cmd: list, limit: float, env=None, first=signal.SIGTERM, expect=0) -> dict:
        """`cmd` with its output in <name>.log, given `limit` seconds in all: `first` (SIGTERM: a training run
        checkpoints and leaves; SIGINT: pytest writes its report) to its whole process group KILL_GRACE seconds
        before the limit, then SIGKILL. Its state: ok (exit status `expect`; None: any), failed, cut, or not reached
        (no time left)."""
        log_path = os.path.join(self.dir, f"{name}.log")
        if limit < KILL_GRACE + 5:
            return {"state": "not reached", "status": "not reached: the budget is spent", "seconds": 0.0}
        print(f"--- {name}: {shlex.join(map(str, cmd))}  (limit {limit:.0f} s)", flush=True)
        start = time.monotonic()
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(map(str, cmd))}\n")
            log.flush()
            proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit - KILL_GRACE)
                state, status = ("ok", "ok") if expect in (rc, None) else ("failed", f"failed (exit status {rc})")
            except subprocess.TimeoutExpired:
                stop(proc, first)
                state, status = "cut", f"cut at its limit of {limit:.0f} s"
            except Cut:
                stop(proc, first)
                raise
        seconds = time.monotonic() - start
        print(f"    {status} in {seconds:.0f} s", flush=True)
        return {"state": state, "status": status, "seconds": round(seconds, 1), "log": log_path}

    def train(self, name: str, flags: list, nproc: int, limit: float, script="train_ddp.py", env=None,
              expect=0) -> dict:
        cmd = [*self.torchrun, f"--nproc_per_node={nproc}", script, *flags]
        return self.run(name, cmd, limit, env=env, expect=expect)

    def device_flags(self) -> list:
        return ["--device", "cpu", "--amp", "off"] if self.dry else []

    # ------------------------------------------------------------------ the steps: each fills `result` in place

    def step_bench(self, result: dict, limit: float) -> None:
        path = os.path.join(self.dir, "bench.json")
        result.update(self.train("bench", ["--compile", *self.bench_flags(), "--json", path], 1, limit,
                                 script="bench.py"))
        if os.path.exists(path):  # bench.py writes it once the img/s exists, then again with the rest
            ours = json.load(open(path)).get("ours", {})
            result.update(images_per_s=ours.get("images_per_s"), step_ms=ours["step_s"] * 1e3 if "step_s" in ours
                          else None, mfu=ours.get("mfu"), peak_memory_gib=ours.get("peak_memory_gib"), json=path)

    def bench_flags(self) -> list:
        if self.dry:
            return ["--depth", "10", "--widen-factor", "1", "--batch-size", "32", "--steps", "1", "--warmup", "1",
                    "--train-size", "64", "--workers", "1", "--compile-backend", "eager", *self.device_flags()]
        return []

    def step_tests(self, result: dict, limit: float) -> None:
        start = time.monotonic()
        select = ["-k", DRY_TESTS] if self.dry else []
        pytest = [self.python, "-m", "pytest", "tests/gpu", "-o", "addopts=", "-p", "no:cacheprovider", *select]
        collected = subprocess.run([*pytest, "--collect-only", "-q"], cwd=ROOT, capture_output=True, text=True,
                                   timeout=max(10.0, limit / 2), env={**os.environ, **self.stand_in()})
        ids = [line for line in collected.stdout.splitlines() if "::" in line]  # -q: a line per test selected
        result["expected"] = len(ids) if collected.returncode == 0 else None
        junit = os.path.join(self.dir, "tests.xml")
        cmd = [*pytest, "-ra", "-q", f"--junitxml={junit}", *([] if self.dry else self.workers())]
        result.update(self.run("tests", cmd, limit - (time.monotonic() - start), env=self.stand_in(),
                               first=signal.SIGINT))  # stopped: pytest still writes tests.xml
        if os.path.exists(junit):
            text = open(junit).read()
            counts = re.search(r'<testsuite [^>]*errors="(\d+)" failures="(\d+)" skipped="(\d+)" tests="(\d+)"',
                               text)
            if counts:
                errors, failures, skipped, tests = map(int, counts.groups())
                result.update(run=tests, passed=tests - errors - failures - skipped, failed=failures + errors,
                              skipped=skipped,
                              failed_names=re.findall(r'<testcase [^>]*name="([^"]+)"[^>]*>\s*<(?:failure|error)',
                                                      text))
        if result.get("expected") is not None:
            result["not_run"] = result["expected"] - result.get("run", 0)

    def stand_in(self) -> dict:
        return {"GPU_TESTS_ON_CPU": "1"} if self.dry else {}

    def workers(self) -> list:
        """pytest-xdist's workers, where installed: one per two cores, 2 to 8 (each test starts its own ranks), each
        test on the next free worker, test_gpu_options.py's tests on one (they share one run: its xdist_group)."""
        xdist = self.query("import importlib.util as u; print(bool(u.find_spec('xdist')))") == "True"
        return ["-n", str(max(2, min(8, (os.cpu_count() or 2) // 2))), "--dist", "loadgroup"] if xdist else []

    def fashion_dir(self):
        for d in ([self.args.fashion_dir] if self.args.fashion_dir else FASHION_DIRS):
            if os.path.exists(os.path.join(d, "t10k-labels-idx1-ubyte.gz")):
                return d
        return None

    def step_fashion(self, result: dict, limit: float) -> None:
        script = write_fashion_script(self.dir)
        # In memory: an epoch's checkpoint (90 MB for WRN-16-8) then costs no disk write.
        shm = "/dev/shm" if (self.probe.get("dev_shm_free_gib") or 0) >= 1 else None
        out = tempfile.mkdtemp(prefix="gpu-checklist-fashion-", dir=shm)
        if self.dry:
            flags = [*FASHION, "--depth", "10", "--widen-factor", "1", "--batch-size", "64", "--epochs", "1",
                     "--train-size", "256", "--test-size", "128", "--workers", "0", *self.device_flags()]
        else:
            flags = [*FASHION, "--epochs", str(self.args.fashion_epochs), "--compile", "--amp", "bf16"]
        result.update(command=flags, out_dir=out)
        try:
            result.update(self.train("fashion", [*flags, "--data-dir", self.fashion_dir(), "--out-dir", out], 1,
                                     limit, script=script, env={"PYTHONPATH": ROOT}))
            metrics_path = os.path.join(out, "metrics.jsonl")
            if os.path.exists(metrics_path):
                shutil.copy(metrics_path, os.path.join(self.dir, "fashion-metrics.jsonl"))
                result.update(fashion_figures([json.loads(line) for line in open(metrics_path)]))
        finally:
            shutil.rmtree(out, ignore_errors=True)  # checkpoints: not results

    def step_exactness(self, result: dict, limit: float) -> None:
        """Tensor for tensor, the checkpoints' weights and buffers: a run stopped mid-epoch and resumed, a repeat of
        the uninterrupted run (default kernels), and (2 GPUs) 1 x 2 micro-steps against 2 x 1, each against the
        uninterrupted run (or the 2-GPU run); each comparison saved as soon as it is made."""
        deadline = time.monotonic() + limit
        model = ["--depth", "10", "--widen-factor", "1" if self.dry else "2", *self.device_flags()]
        exact = list(EXACT)
        for flag, value in (DRY_EXACT.items() if self.dry else ()):
            exact[exact.index(flag) + 1] = value
        # a dry run: --deterministic's alone (the same steps; CI's minutes are few)
        modes = [("deterministic", ["--deterministic"])] + ([] if self.dry else [("default", [])])  # the claim first
        if self.gpus < 2:
            result["note"] = "one GPU: 1 x 2 micro-steps against 2 processes needs 2 (NCCL refuses a shared GPU)"
        states = []
        for mode, extra in modes:
            flags, base = [*exact, *model, *extra], os.path.join(self.dir, "exact", mode)
            os.makedirs(base, exist_ok=True)
            runs, comparisons = {}, {}
            result[mode] = {"runs": runs, "comparisons": comparisons}

            def train(name, more=(), nproc=1, env=None, out_dir=None, expect=0):
                out, env = ["--out-dir", os.path.join(base, out_dir or name)], {"OMP_NUM_THREADS": "1", **(env or {})}
                run = self.train(f"exact-{mode}-{name}", [*flags, *more, *out], nproc, deadline - time.monotonic(),
                                 env=env, expect=expect)
                runs[name] = run["status"]
                states.append((run["state"], f"{mode} {name}: {run['status']}"))
                return run["state"] == "ok"

            def compared(name, comparison):
                comparisons[name] = comparison
                print(f"    {mode}: {name}: {describe(comparison)}", flush=True)
                self.save()

            if not train("uninterrupted"):
                continue
            stop_file = os.path.join(base, "stop")
            open(stop_file, "w").close()  # seen at the first check: step 2 of epoch 1
            # it checkpoints and exits to be resumed (75, which torchrun reports as 1): stopped_at checks it did
            train("stopped", ["--checkpoint-every", "2"], env={"DDP_STOP_FILE": stop_file}, expect=None)
            os.remove(stop_file)
            stopped = stopped_at(base)  # a comparison of a run that never stopped would prove nothing
            if stopped is not None:
                compared("resumed mid-epoch", {"error": stopped})
            elif train("resumed", out_dir="stopped"):
                compared("resumed mid-epoch", compare(base, "stopped"))
            if mode == "default" and train("repeat"):  # two identical runs: what the default kernels leave alike
                compared("repeat", compare(base, "repeat"))
            if self.gpus >= 2:
                micro = str(int(exact[exact.index("--batch-size") + 1]) // 2)
                if train("accumulation", ["--micro-batch", micro]) and train("two", nproc=2):
                    compared("1 x 2 micro-steps against 2 x 1", compare(base, "accumulation", against="two"))
        shutil.rmtree(os.path.join(self.dir, "exact"), ignore_errors=True)
        worst = [(state, why) for state, why in states if state != "ok"]
        state = next((s for s in ("failed", "cut", "not reached") if s in {s for s, _ in worst}), "ok")
        result.update(state=state, status="; ".join(why for _, why in worst) or "ok")

    def step_candidates(self, result: dict, limit: float) -> None:
        path = os.path.join(self.dir, "candidates.json")
        result.update(self.train("candidates", ["--compile", *self.bench_flags(), "--candidates", "--json", path], 1,
                                 limit, script="bench.py"))
        rows = json.load(open(path)).get("candidates", {}) if os.path.exists(path) else {}  # written after each row
        result["rows"] = {name: {key: r.get(key) for key in ("images_per_s", "ratio", "warmup_s", "graphs",
                                                             "graphs_while_timed", "cudagraph_skips")}
                          for name, r in rows.get("rows", {}).items()}
        if rows.get("evaluation"):
            result["evaluation"] = rows["evaluation"]
        if os.path.exists(path):
            result["json"] = path

    # ------------------------------------------------------------------ the summary

    def summary(self) -> dict:
        return {**self.meta, "budget_s": self.args.budget, "seconds": round(time.monotonic() - self.started, 1),
                "steps": self.results}

    def save(self) -> None:
        """summary.json, summary.md, and with $OUT the two and an archive of the folder there; each part's failure
        said, not raised: a step's results are never lost to their rendering."""
        summary = self.summary()
        parts = [("summary.json", lambda: json.dumps(summary, indent=2, default=str)),
                 ("summary.md", lambda: render(summary))]
        for name, text in parts:
            try:
                content = text()
            except Exception as e:  # the figures are in summary.json whatever the rendering does
                content = f"(rendering failed: {type(e).__name__}: {e}; summary.json has the figures)\n"
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(content)
        out = os.environ.get("OUT")
        if out:  # the device tool brings back at most 8 files: the two summaries and one archive of the rest
            try:
                for name in ("summary.json", "summary.md"):
                    shutil.copy(os.path.join(self.dir, name), os.path.join(out, name))
                with tarfile.open(os.path.join(out, "results.tar.gz.part"), "w:gz") as tar:
                    tar.add(self.dir, arcname=self.tag)
                os.replace(os.path.join(out, "results.tar.gz.part"), os.path.join(out, "results.tar.gz"))
            except OSError as e:
                print(f"warning: could not copy the results into $OUT ({out}): {e}", flush=True)


def stop(proc, first) -> None:
    """`first` to the process's group, SIGKILL KILL_GRACE seconds later if it is still there."""
    try:
        os.killpg(proc.pid, first)
        proc.wait(timeout=KILL_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


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


def fashion_figures(rows: list) -> dict:
    """From the run's metrics.jsonl: the epochs, the accuracies, and the training seconds to 95% as measured
    (train_time_s, the epochs' training time) and without the first epoch's compile: that epoch counted at the
    steady rate of the later ones (the median img/s of epochs 2 on). Empty rows (a run cut in its first epoch): {}."""
    if not rows:
        return {"epochs": 0}
    reached = next((m for m in rows if m["val_acc"] >= 0.95), None)
    steady = statistics.median(m["images_per_s"] for m in rows[1:]) if len(rows) > 1 else None
    without_compile = None
    if reached and steady:
        without_compile = reached["train_time_s"] - rows[0]["epoch_time_s"] + rows[0]["train_samples"] / steady
    return {"epochs": len(rows), "final_acc": rows[-1]["val_acc"], "best_acc": max(m["val_acc"] for m in rows),
            "train_s": rows[-1]["train_time_s"], "run_s": rows[-1]["run_time_s"],
            "first_epoch_s": rows[0]["epoch_time_s"], "images_per_s_after_first": steady,
            "epoch_at_95": reached and reached["epoch"], "train_s_to_95": reached and reached["train_time_s"],
            "train_s_to_95_without_compile": without_compile, "run_s_to_95": reached and reached["run_time_s"]}


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


def compare(base: str, name: str, against: str = "uninterrupted") -> dict:
    """The checkpoints' model tensors (weights and BatchNorm buffers) of run `name` against run `against`: how many
    are equal bit for bit, and the largest difference."""
    import torch
    paths = [os.path.join(base, n, "checkpoint.pt") for n in (name, against)]
    if not all(os.path.exists(p) for p in paths):
        return {"error": "a run left no checkpoint"}
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


def num(value, spec: str = ",.0f", scale: float = 1, unit: str = "") -> str:
    """A figure for summary.md, or "n/a" where the step did not get that far."""
    return "n/a" if value is None else f"{value * scale:{spec}}{unit}"


def render(summary: dict) -> str:
    """summary.md: every planned step's state, then what each step gave, as rows for bench-results/README.md."""
    s, lines = summary["steps"], []
    where = f"{summary['device']}, torch {summary['torch']}, commit {summary['commit']}"
    lines.append(f"# GPU checklist, {summary['date']}: {where}{' (DRY RUN on a CPU)' if summary['dry_run'] else ''}")
    lines.append(f"\n{summary['seconds']:.0f} s of a {summary['budget_s']:.0f} s budget; results: "
                 f"{summary['results']}\n\nProbe: {json.dumps(summary['probe'])}\n")
    lines.append("| step | state | status | seconds | cap |\n|---|---|---|---|---|")
    lines += [f"| {name} | {r.get('state')} | {r.get('status')} | {num(r.get('seconds'), '.0f')} | "
              f"{summary['plan'].get(name)} |" for name, r in s.items()]
    t = s.get("tests", {})
    if "expected" in t:
        lines.append(f"\n**GPU tests**: {num(t.get('passed'))} passed, {num(t.get('failed'))} failed, "
                     f"{num(t.get('skipped'))} skipped of {num(t.get('run'))} run; {num(t['expected'])} expected, "
                     f"{num(t.get('not_run'))} not run" +
                     (f"; failed: {', '.join(t['failed_names'])}" if t.get("failed_names") else ""))
    b = s.get("bench", {})
    if b.get("images_per_s") is not None:
        lines.append(f"\n**Step benchmark**: {num(b['images_per_s'])} img/s, step {num(b.get('step_ms'), '.1f')} ms, "
                     f"MFU {num(b.get('mfu'), '.1f', 100, '%')}, peak {num(b.get('peak_memory_gib'), '.1f')} GiB")
    f = s.get("fashion", {})
    if f.get("epochs"):
        to95 = (f"epoch {f['epoch_at_95']}, **{num(f['train_s_to_95'], '.1f')} s** of training, "
                f"{num(f.get('train_s_to_95_without_compile'), '.1f')} s without the first epoch's compile "
                f"({num(f.get('run_s_to_95'), '.1f')} s with evaluation)" if f.get("epoch_at_95") else "not reached")
        lines.append(f"\n**Fashion-MNIST** ({f['epochs']} epochs): to 95%: {to95}; final "
                     f"**{num(f.get('final_acc'), '.2f', 100, '%')}** (best {num(f.get('best_acc'), '.2f', 100, '%')})"
                     f" after {num(f.get('train_s'))} s of training, {num(f.get('run_s'))} s with evaluation; first "
                     f"epoch {num(f.get('first_epoch_s'), '.1f')} s; {num(f.get('images_per_s_after_first'))} img/s "
                     f"after it")
    x = s.get("exactness", {})
    for mode in ("deterministic", "default"):
        if x.get(mode, {}).get("comparisons"):
            lines.append(f"\n**Exactness, {mode}**: " + "; ".join(f"{n}: {describe(cmp)}"
                                                               for n, cmp in x[mode]["comparisons"].items()))
    if x.get("note"):
        lines.append(f"({x['note']})")
    c = s.get("candidates", {})
    if c.get("rows"):
        lines.append("\n**Speed candidates** (img/s; ratio to the default, the mean of its rows; graphs compiled, "
                     "and while timed; CUDA graphs skipped):\n")
        lines.append("| candidate | img/s | ratio | warm-up s | graphs | while timed | cudagraph skips |\n"
                     "|---|---|---|---|---|---|---|")
        lines += [f"| {n} | {num(r.get('images_per_s'))} | {num(r.get('ratio'), '.3f')} | "
                  f"{num(r.get('warmup_s'), '.1f')} | {num(r.get('graphs'))} | {num(r.get('graphs_while_timed'))} | "
                  f"{num(r.get('cudagraph_skips'))} |" for n, r in c["rows"].items()]
        if c.get("evaluation"):
            e = c["evaluation"]
            lines.append(f"\nEvaluation: {e['images']} test images in {e['eval_s']:.3f} s, "
                         f"{e['share'] * 100:.1f}% of an epoch of 50,000 with it")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dry-run", action="store_true", help="every step end to end on this CPU, tiny configurations")
    p.add_argument("--steps", default=",".join(STEPS), help=f"which steps, in this order: {','.join(STEPS)}")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all the steps, each also under its cap (default: {DEFAULT_BUDGET}; a dry run "
                   f"1800)")
    p.add_argument("--fashion-dir", default=None, help="Fashion-MNIST's four .gz files (default: see below)")
    p.add_argument("--fashion-epochs", type=int, default=FASHION_EPOCHS, help="epochs of the Fashion-MNIST run")
    p.add_argument("--results", default=None, help="the results folder (default: runs/gpu-checklist/<gpu>-<date>)")
    p.add_argument("--python", default=None, help="the Python with torch (default: this one)")
    p.add_argument("--commit", default=None, help="the commit the results are of (default: git's HEAD)")
    args = p.parse_args(argv)
    args.budget = args.budget or (1800 if args.dry_run else DEFAULT_BUDGET)
    asked = [s for s in args.steps.split(",") if s]
    unknown = [s for s in asked if s not in STEPS]
    if unknown or not asked:
        p.error(f"unknown step(s) {', '.join(unknown)}; the steps: {', '.join(STEPS)}")

    def cut(signum, frame):
        raise Cut(signum)
    signal.signal(signal.SIGTERM, cut)
    signal.signal(signal.SIGINT, cut)
    checklist = Checklist(args, [s for s in STEPS if s in asked])
    stopped = None
    for step in checklist.planned:
        result = checklist.results[step]
        if result["state"] == "skipped":
            continue
        limit = checklist.limit(step)
        print(f"\n=== {datetime.datetime.now().isoformat(timespec='seconds')} {step} (limit {limit:.0f} s; "
              f"{checklist.left():.0f} s of the budget left)", flush=True)
        result.clear()
        result.update(state="running", status="running: the checklist was stopped during it")
        checklist.save()
        try:
            getattr(checklist, f"step_{step}")(result, limit)
        except Cut as e:
            stopped = e
            result.update(state="cut", status=f"cut: the checklist got {e} during it")
        except Exception as e:  # a step's own error: said, and the next step still runs
            result.update(state="error", status=f"error: {type(e).__name__}: {e}")
        finally:
            checklist.save()
        if stopped:
            break
    report = render(checklist.summary())
    print("\n" + report, flush=True)
    if stopped:
        return 128 + stopped.signum
    # a step cut or not reached is no failure of the code: summary.md says which, and why
    return 1 if any(r["state"] in ("failed", "error") for r in checklist.results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
