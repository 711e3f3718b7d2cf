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
# Later flags win in argparse: the user's follow "--workers 0", these follow the user's. 64 samples at 16 a step: 4
# steps an epoch; at most 8 a forward: 1 rank x 2 micro-steps, or 2 ranks x 1, the same 2 virtual ranks.
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

    def failure(self) -> str:
        error = self.error_line()
        if SPLIT_ERROR in error or GRADIENT_ERROR in error:  # that guarantee's ✗ line says it
            return f"the run {self.name} failed on another guarantee (its ✗ line)"
        return f"the run {self.name} failed: {error}"

    def state(self) -> dict:
        return torch.load(os.path.join(self.out_dir, "checkpoint.pt"), map_location="cpu", weights_only=True)


def run_self_check(script: str, argv: list, *, build_model, spec_type) -> int:
    """The runs, then a line per guarantee (✔, ✗, or – where the README's rules do not reach); 0 if none is ✗.
    `argv`: the user's flags; build_model(cfg, spec_type(**data_spec)): the script's."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("error: run --self-check with plain python: it starts the ranks it needs", file=sys.stderr)
        return 2
    start, root = time.perf_counter(), tempfile.mkdtemp(prefix="self-check-")
    print(f"Self-check of {script}: short runs on the CPU in {root} (about a minute or two) ...", flush=True)
    flags = ["--workers", "0", *(a for a in argv if a.split("=", 1)[0] not in DROPPED_FLAGS), *OWN_FLAGS]
    try:
        lines = check_guarantees(script, flags, root, build_model, spec_type)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for line in lines:
        print(line)
    held, failed = (sum(line.startswith(mark) for line in lines) for mark in "✔✗")
    beyond = f", {len(lines) - held - failed} beyond the rules (–)" if held + failed < len(lines) else ""
    print(f"Self-check: {held} of {len(lines)} hold, {failed} failed{beyond}, in {time.perf_counter() - start:.0f} s"
          + (": see the ✗ lines" if failed else ""), flush=True)
    return 1 if failed else 0


def check_guarantees(script: str, flags: list, root: str, build_model, spec_type) -> list:
    """The runs, launched as a user would, each in a folder under root; then a line per guarantee."""
    def launch(name: str, nproc: int = 1, extra=(), env=None, out_dir: str | None = None) -> Run:
        out_dir = os.path.join(root, out_dir or name)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                    if nproc > 1 else [sys.executable])
        command = [*launcher, script, *flags, "--out-dir", out_dir, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Run(name, 124, "", f"error: it ran past {RUN_TIMEOUT_S} s", out_dir)
        return Run(name, proc.returncode, proc.stdout, proc.stderr, out_dir)

    one, two = launch("one"), launch("two", nproc=2)  # 1 rank x 2 micro-steps; 2 ranks x 1
    resume = check_resume(launch, root, one)
    evaluations = []
    for nproc in (1, 2, 3) if one.status == 0 else ():  # the run one's checkpoint; each eval.json read, removed
        run = launch(f"evaluate-{nproc}", nproc, ["--evaluate"], out_dir="one")
        evaluations.append(run)
        if run.status == 0:
            with open(os.path.join(run.out_dir, "eval.json")) as f:
                run.score = {**json.load(f), "name": run.name}
            os.remove(f.name)
    what = "every parameter gets a gradient"
    gradients = (f"✔ {what}" if two.status == 0 else f"✗ {what}: {two.error_line().removeprefix('error: ')}"
                 if GRADIENT_ERROR in two.error_line() else f"✗ {what}: not checked: {two.failure()}")
    return [resume, check_ranks_against_steps(one, two, build_model, spec_type), check_splits([two, *evaluations[1:]]),
            check_evaluations(one, evaluations), gradients]


def check_resume(launch, root: str, one: Run) -> str:
    """A run stopped mid-epoch 1 by its stop file, then resumed, against the run one, uninterrupted."""
    what = "resumed mid-epoch against uninterrupted"
    if one.status != 0:
        return f"✗ {what}: not checked: {one.failure()}"
    stop_file = os.path.join(root, "stop")
    open(stop_file, "w").close()  # seen at the first check: step 2 of epoch 1
    stopped = launch("stopped", extra=["--checkpoint-every", "2"], env={"DDP_STOP_FILE": stop_file})
    os.remove(stop_file)
    if not os.path.exists(os.path.join(stopped.out_dir, "checkpoint.pt")):
        return f"✗ {what}: {stopped.failure()}"
    progress = stopped.state()["progress"]
    if progress["epoch"] != 0 or progress["position"] == 0:  # a resume from an epoch's end proves less
        return (f"✗ {what}: the run stopped did not stop mid-epoch 1 (epoch {progress['epoch']} done, position "
                f"{progress['position']})")
    resumed = launch("resumed", out_dir="stopped")
    if resumed.status != 0:
        return f"✗ {what}: {resumed.failure()}"
    different = differences(resumed.state(), one.state())
    if not different:
        return f"✔ {what}: bit for bit"
    if SEED_NOTE in one.stdout:  # the training transform's check
        cause = ("the training transform draws from a generator the loaders do not seed (Python's random, NumPy, "
                 "its own torch.Generator): draw with torch.rand or torch.randint")
    elif (repeat := launch("repeat")).status != 0:
        cause = f"unknown: {repeat.failure()}"
    elif differences(repeat.state(), one.state()):  # a repeat differs too where randomness escapes the seeds
        cause = ("two identical runs differ: randomness the seeds do not reach (Python's random, NumPy, a generator "
                 "of its own): draw from torch's")
    else:
        cause = ("state the checkpoint misses: a tensor kept as a plain attribute (register_buffer it) or a stateful "
                 "object not in Checkpoint's optional (ADAPT 4/6)")
    return f"✗ {what}: the first tensor that differs is {different[0][0]}{largest(different)}; likely cause: {cause}"


def check_ranks_against_steps(one: Run, two: Run, build_model, spec_type) -> str:
    what = "2 ranks x 1 against 1 rank x 2 micro-steps"
    failed = next((run for run in (one, two) if run.status != 0), None)
    if failed is not None:
        return f"✗ {what}: not checked: {failed.failure()}"
    config = one.state()["config"]
    spec = spec_type(**config["data_spec"])
    torch.manual_seed(0)
    model = build_model(SimpleNamespace(**config), spec).train()
    images = torch.rand(2, spec.channels, spec.height, spec.width)
    rng = torch.get_rng_state()
    with torch.no_grad():
        model(images)
    if not torch.equal(rng, torch.get_rng_state()):
        return (f"– {what}: not compared: the model's forward draws random numbers (dropout, say), and each rank "
                f"draws its own by design; the other lines hold as usual")
    different = differences(two.state(), one.state())
    if not different:
        return f"✔ {what}: bit for bit"
    beyond = [(key, x, y) for key, x, y in different
              if not (tensors(x, y) and torch.allclose(x.double(), y.double(), rtol=RTOL, atol=ATOL))]
    if not beyond:
        return f"✔ {what}: within rounding{largest(different)}"
    return (f"✗ {what}: the first tensor that differs is {beyond[0][0]}{largest(beyond)}; likely cause: a model or "
            f"loss that works per forward or per batch, not per sample (state kept across forwards, batch statistics "
            f"other than BatchNorm's, a mean loss: train_step sums), or randomness the seeds do not reach")


def check_splits(runs: list) -> str:
    what = "the training and test splits are the same on every rank"
    for run in runs:
        if SPLIT_ERROR in run.error_line() and run.status != 0:
            return f"✗ {what}: {run.error_line().removeprefix('error: ')}"
    reached = [run for run in runs if "\nData: " in f"\n{run.stdout}" or "Evaluating " in run.stdout]
    if not reached:
        return f"✗ {what}: not checked: {runs[0].failure()}"
    return f"✔ {what} (compared in {len(reached)} runs of 2 and 3 ranks)"


def check_evaluations(one: Run, evaluations: list) -> str:
    what = "evaluation on 1, 2 and 3 ranks"
    if not evaluations:
        return f"✗ {what}: not checked: {one.failure()}"
    failed = next((run for run in evaluations if run.status != 0), None)
    if failed is not None:
        return f"✗ {what}: {failed.failure()}"
    first = evaluations[0].score
    for score in (run.score for run in evaluations):
        if score["val_count"] != TEST_SIZE:
            return f"✗ {what}: {score['name']} scored {score['val_count']} of the {TEST_SIZE} test samples"
        if score["val_acc"] != first["val_acc"] or not math.isclose(score["val_loss"], first["val_loss"],
                                                                    rel_tol=RTOL, abs_tol=ATOL):
            return (f"✗ {what}: {score['name']} scored accuracy {score['val_acc']:.6f}, loss "
                    f"{score['val_loss']:.6g}; {first['name']} {first['val_acc']:.6f}, {first['val_loss']:.6g}")
    return (f"✔ {what}: each of the {TEST_SIZE} test samples counted once, the same scores (accuracy "
            f"{first['val_acc']:.4f}, loss {first['val_loss']:.4f})")


def differences(a: dict, b: dict) -> list:
    """(key, a's, b's) for each value that differs between two checkpoints' states, nests flattened."""
    names = [name for name in b if name not in NOT_STATE]
    a, b = (flatten({name: c.get(name) for name in names}) for c in (a, b))
    pairs = [(key, a.get(key), y) for key, y in b.items()]
    return [(key, x, y) for key, x, y in pairs
            if not (torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y)]


def flatten(value, key: str = "") -> dict:
    if isinstance(value, (dict, list, tuple)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return {k: v for i, item in items for k, v in flatten(item, f"{key}.{i}".lstrip(".")).items()}
    return {key: value}


def tensors(x, y) -> bool:
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape


def largest(different: list) -> str:
    size = max((float((x.double() - y.double()).abs().max()) for _, x, y in different
                if tensors(x, y) and x.is_floating_point()), default=None)
    return "" if size is None else f" (largest difference {size:.2g})"
