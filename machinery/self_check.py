"""--self-check: an adapted recipe's ADAPT places run through the README's guarantees in short CPU runs of the script
itself (one thread per process), a line per guarantee. The recipe hands in its path and build_model."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

TEST_SIZE = 31  # divisible by neither 2 nor 3: the evaluations' shards are uneven
# Later flags win in argparse: these follow the user's. 64 samples at 16 a step: 4 steps an epoch; at most 8 a
# forward: 1 rank x 2 micro-steps, or 2 ranks x 1, the same 2 virtual ranks.
OWN_FLAGS = ["--device", "cpu", "--amp", "off", "--epochs", "2", "--patience", "0", "--log-every", "0",
             "--batch-size", "16", "--micro-batch", "8", "--train-size", "64", "--test-size", str(TEST_SIZE),
             "--checkpoint-every", "0", "--stop-after-epoch", "0", "--keep-checkpoints", "1"]
DROPPED_FLAGS = {"--self-check", "--compile", "--evaluate", "--tensorboard", "--profile"}  # on or off alone
RUN_TIMEOUT_S = 300
RTOL, ATOL = 1e-4, 1e-5  # 2 ranks x 1 against 1 rank x 2 micro-steps: beyond this, more than rounding
SPLIT_ERROR = "split differs by rank"  # machinery.resume.check_same_splits' UserError
GRADIENT_ERROR = "got no gradient"  # train_utils.check_parameters_used's UserError
SEED_NOTE = "the training transform gave two outputs for one seed"  # machinery.transform_checks' note
NOT_STATE = {"progress", "config", "model_config", "data", "world_size", "rng_cpu", "rng_cuda"}  # a checkpoint's rest


@dataclass
class Run:
    name: str
    status: int
    stdout: str
    stderr: str
    out_dir: str
    score: dict | None = None  # an evaluation's eval.json

    def error_line(self) -> str:
        """Its first `error: ` line (the project's, or torchrun's copy), else its last on stderr (an exception's)."""
        lines = [line.strip() for line in self.stderr.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("error: ")]
        return (said or lines or [f"exit status {self.status}"])[0 if said else -1]

    def describe_failure(self) -> str:
        error = self.error_line()
        if SPLIT_ERROR in error or GRADIENT_ERROR in error:  # that guarantee's ✗ line says it
            return f"the run {self.name} failed on another guarantee (its ✗ line)"
        return f"the run {self.name} failed: {error}"

    def load_checkpoint(self) -> dict:
        return torch.load(os.path.join(self.out_dir, "checkpoint.pt"), map_location="cpu", weights_only=True)


def run_self_check(script: str, argv: list, *, build_model, spec_type) -> int:
    """The runs, then a line per guarantee (✔, ✗, or – where the README's rules do not reach); 0 if none is ✗.
    `argv`: the user's flags; build_model(cfg, spec_type(**data_spec)): the script's."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("error: run --self-check with plain python: it starts the ranks it needs", file=sys.stderr)
        return 2
    start, root = time.perf_counter(), tempfile.mkdtemp(prefix="self-check-")
    print(f"Self-check of {script}: short runs on the CPU in {root} (about a minute or two) ...", flush=True)
    try:
        lines = check_guarantees(SelfCheck(script, argv, root), build_model, spec_type)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for line in lines:
        print(line)
    held, failed = (sum(line.startswith(mark) for line in lines) for mark in "✔✗")
    beyond = f", {len(lines) - held - failed} beyond the rules (–)" if held + failed < len(lines) else ""
    print(f"Self-check: {held} of {len(lines)} hold, {failed} failed{beyond}, in {time.perf_counter() - start:.0f} s"
          + (": see the ✗ lines" if failed else ""), flush=True)
    return 1 if failed else 0


class SelfCheck:
    """Launches the script as a user would, on the CPU, one thread a process, each run in a folder under root."""

    def __init__(self, script: str, argv: list, root: str):
        argv = [a for a in argv if a.split("=", 1)[0] not in DROPPED_FLAGS]
        given_workers = any(a.split("=", 1)[0] == "--workers" for a in argv)
        self.script, self.root = script, root
        self.flags = argv + OWN_FLAGS + ([] if given_workers else ["--workers", "0"])

    def launch(self, name: str, nproc: int = 1, extra=(), env=None, out_dir: str | None = None) -> Run:
        out_dir = os.path.join(self.root, out_dir or name)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                    if nproc > 1 else [sys.executable])
        command = [*launcher, self.script, *self.flags, "--out-dir", out_dir, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Run(name, 124, "", f"error: it ran past {RUN_TIMEOUT_S} s", out_dir)
        return Run(name, proc.returncode, proc.stdout, proc.stderr, out_dir)

    def evaluate(self, nproc: int) -> Run:
        """--evaluate of the run one's checkpoint on nproc ranks, its eval.json read before the next one's."""
        run = self.launch(f"evaluate-{nproc}", nproc=nproc, extra=["--evaluate"], out_dir="one")
        path = os.path.join(run.out_dir, "eval.json")
        if run.status == 0:
            with open(path) as f:
                run.score = {**json.load(f), "name": run.name}
            os.remove(path)
        return run

    def train_stopped(self) -> tuple:
        """(the run stopped mid-epoch 1 by its stop file, then resumed, or None), or why not."""
        stop_file = os.path.join(self.root, "stop")
        open(stop_file, "w").close()  # seen at the first check: step 2 of epoch 1
        stopped = self.launch("stopped", extra=["--checkpoint-every", "2"], env={"DDP_STOP_FILE": stop_file})
        os.remove(stop_file)
        if not os.path.exists(os.path.join(stopped.out_dir, "checkpoint.pt")):
            return None, stopped.describe_failure()
        progress = stopped.load_checkpoint()["progress"]
        if progress["epoch"] != 0 or progress["position"] == 0:  # a resume from an epoch's end proves less
            return None, (f"the run stopped did not stop mid-epoch 1 (epoch {progress['epoch']} done, position "
                          f"{progress['position']})")
        resumed = self.launch("resumed", out_dir="stopped")
        return (resumed, None) if resumed.status == 0 else (None, resumed.describe_failure())


def check_guarantees(check: SelfCheck, build_model, spec_type) -> list:
    one = check.launch("one")  # 1 rank x 2 micro-steps
    two = check.launch("two", nproc=2)  # 2 ranks x 1
    if one.status != 0:
        evaluations, resume = [], f"✗ resumed mid-epoch against uninterrupted: not checked: {one.describe_failure()}"
    else:
        resume = check_resume(check, one)
        evaluations = [check.evaluate(n) for n in (1, 2, 3)]
    return [resume, check_ranks_against_steps(one, two, build_model, spec_type), check_splits([two, *evaluations[1:]]),
            check_evaluations(one, evaluations), check_gradients(two)]


def check_resume(check: SelfCheck, one: Run) -> str:
    what = "resumed mid-epoch against uninterrupted"
    resumed, why = check.train_stopped()
    if resumed is None:
        return f"✗ {what}: {why}"
    difference = first_difference(resumed.load_checkpoint(), one.load_checkpoint())
    if difference is None:
        return f"✔ {what}: bit for bit"
    return f"✗ {what}: {describe_difference(difference)}; likely cause: {find_resume_cause(check, one)}"


def find_resume_cause(check: SelfCheck, one: Run) -> str:
    """Why a resumed run differs: the training transform's check (a note in the log), else a repeat of the
    uninterrupted run, which differs too where randomness escapes the seeds."""
    if SEED_NOTE in one.stdout:
        return ("the training transform draws from a generator the loaders do not seed (Python's random, NumPy, "
                "a torch.Generator of its own): draw with torch.rand or torch.randint (docs/adapt.md)")
    repeat = check.launch("repeat")
    if repeat.status != 0:
        return f"unknown: {repeat.describe_failure()}"
    if first_difference(repeat.load_checkpoint(), one.load_checkpoint()) is not None:
        return ("two identical runs differ: randomness the seeds do not reach (an augmentation or model drawing "
                "from Python's random, NumPy or a generator of its own): draw from torch's generator")
    return ("state the checkpoint misses: a tensor kept as a plain attribute (register_buffer it), or a stateful "
            "object not registered with Checkpoint's optional, ADAPT (4/6)")


def check_ranks_against_steps(one: Run, two: Run, build_model, spec_type) -> str:
    what = "2 ranks x 1 against 1 rank x 2 micro-steps"
    failed = next((run for run in (one, two) if run.status != 0), None)
    if failed is not None:
        return f"✗ {what}: not checked: {failed.describe_failure()}"
    reference = one.load_checkpoint()
    if forward_draws(reference["config"], build_model, spec_type):
        return (f"– {what}: not compared: the model's forward draws random numbers (dropout, say), and each rank "
                f"draws its own by design; the other lines hold as usual")
    difference = first_difference(two.load_checkpoint(), reference, exact=False)
    if difference is None:
        return f"✔ {what}: bit for bit"
    if difference[2]:  # within rounding
        return f"✔ {what}: within rounding (largest difference {difference[1]:.2g})"
    return (f"✗ {what}: {describe_difference(difference)}; likely cause: a model or loss that works per forward or "
            f"per batch, not per sample (state kept across forwards, batch statistics other than BatchNorm's, a mean "
            f"loss: train_step sums), or randomness the seeds do not reach")


def check_splits(runs: list) -> str:
    what = "the training and test splits are the same on every rank"
    for run in runs:
        if SPLIT_ERROR in run.error_line() and run.status != 0:
            return f"✗ {what}: {run.error_line().removeprefix('error: ')}"
    reached = [run for run in runs if "\nData: " in f"\n{run.stdout}" or "Evaluating " in run.stdout]
    if not reached:
        return f"✗ {what}: not checked: {runs[0].describe_failure()}"
    return f"✔ {what} (compared in {len(reached)} runs of 2 and 3 ranks)"


def check_evaluations(one: Run, evaluations: list) -> str:
    what = "evaluation on 1, 2 and 3 ranks"
    if not evaluations:
        return f"✗ {what}: not checked: {one.describe_failure()}"
    failed = next((run for run in evaluations if run.status != 0), None)
    if failed is not None:
        return f"✗ {what}: {failed.describe_failure()}"
    (first, *rest), size = [run.score for run in evaluations], TEST_SIZE
    for score in (first, *rest):
        if score["val_count"] != size:
            return f"✗ {what}: {score['name']} scored {score['val_count']} of the {size} test samples"
    for score in rest:
        if score["val_acc"] != first["val_acc"] or not math.isclose(score["val_loss"], first["val_loss"],
                                                                    rel_tol=RTOL, abs_tol=ATOL):
            return (f"✗ {what}: {score['name']} scored accuracy {score['val_acc']:.6f}, loss "
                    f"{score['val_loss']:.6g}; {first['name']} {first['val_acc']:.6f}, {first['val_loss']:.6g}")
    return (f"✔ {what}: each of the {size} test samples counted once, the same scores (accuracy "
            f"{first['val_acc']:.4f}, loss {first['val_loss']:.4f})")


def check_gradients(two: Run) -> str:
    what = "every parameter gets a gradient"
    if two.status == 0:
        return f"✔ {what}"
    error = two.error_line().removeprefix("error: ")
    if GRADIENT_ERROR in error:
        return f"✗ {what}: {error}"
    return f"✗ {what}: not checked: {two.describe_failure()}"


def forward_draws(config: dict, build_model, spec_type) -> bool:
    """Whether the model's forward in training draws from torch's generator (dropout), on two images."""
    spec = spec_type(**config["data_spec"])
    torch.manual_seed(0)
    model = build_model(SimpleNamespace(**config), spec).train()
    images = torch.rand(2, spec.channels, spec.height, spec.width)
    state = torch.get_rng_state()
    with torch.no_grad():
        model(images)
    return not torch.equal(state, torch.get_rng_state())


def first_difference(a: dict, b: dict, exact: bool = True):
    """None if the checkpoints' states are equal bit for bit, else (the first differing key, the largest
    difference, whether all are within rounding)."""
    names = [name for name in b if name not in NOT_STATE]
    pairs = [pair for name in names for pair in flatten(name, a.get(name), b[name])]
    different = [(key, x, y) for key, x, y in pairs if not same(x, y)]
    if not different:
        return None
    largest = max((float((x.double() - y.double()).abs().max()) for _, x, y in different
                   if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                   and x.is_floating_point()), default=math.inf)
    close = not exact and all(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                              and torch.allclose(x.double(), y.double(), rtol=RTOL, atol=ATOL)
                              for _, x, y in different)
    return different[0][0], largest, close


def flatten(key: str, a, b):
    if isinstance(b, dict):
        for k, v in b.items():
            yield from flatten(f"{key}.{k}", a.get(k) if isinstance(a, dict) else None, v)
    elif isinstance(b, (list, tuple)):
        for i, v in enumerate(b):
            yield from flatten(f"{key}.{i}", a[i] if isinstance(a, (list, tuple)) and i < len(a) else None, v)
    else:
        yield key, a, b


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.shape == y.shape and torch.equal(x, y)
    return x == y


def describe_difference(difference) -> str:
    key, largest, _ = difference
    return f"the first tensor that differs is {key}" + (f" (largest difference {largest:.2g})"
                                                         if math.isfinite(largest) else "")
