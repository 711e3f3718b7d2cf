"""pytest's fixtures and hooks (the files' order; fast_exit/ on PYTHONPATH), nothing else: the library the tests
import is support.py. This file puts the repository root (train_ddp.py and its modules) and tests/ (support.py)
on sys.path, so that `from support import ...` works from tests/unit/, tests/e2e/ and tests/gpu/ alike."""
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(TESTS), TESTS):  # the repository root, then tests/
    if path not in sys.path:
        sys.path.insert(0, path)

from support import (ACCUM_RUN, CKPT_RUN, FAST_EXIT, STARTED, kill_all, launch_forked,  # noqa: E402
                     load_model_state, made_once, run_in_process, write_cifar100)


# Each end-to-end file's seconds on a fresh clone (2026-11-27, 966bb98: setup, call and teardown summed, two
# files at a time on 2 cores; the Slurm file waits on Slurm's clock, the adapt file holds the README's
# Fashion-MNIST example). pytest-xdist's workers take the files in this order, longest first, so that the last
# files to start are short and neither worker runs alone for long at the end: 70 s less than xdist's own order
# (by number of tests, which ran 2-test files of 2 minutes last), simulated on the times of 8f31cce, a whole file
# per worker as `--dist loadfile` gives them. A file not listed (the unit files, a new one) goes first: a short
# one costs nothing there, a long one is where it should be; add a new end-to-end file's time here.
FILE_SECONDS = {  # measured: the per-file sums of a --durations run, 2026-11-29 (41a3b28, plus the comm hooks' tests)
    "test_slurm_jobs.py": 555, "test_adapt.py": 397, "test_training_run.py": 199, "test_write_failures.py": 195,
    "test_diagnostics.py": 176, "test_gpu_checklist.py": 140, "test_fault_tolerance.py": 140,
    "test_stop_signals.py": 128, "test_tools.py": 127, "test_elastic.py": 119, "test_resume.py": 110,
    "test_lr_rule.py": 76, "test_tool_signals.py": 69, "test_records_and_progress.py": 66, "test_out_dir.py": 62,
    "test_modern_recipe.py": 55, "test_ddp_math.py": 35, "test_comm_hooks.py": 30, "test_bad_input.py": 30,
    "test_stop_request.py": 11, "test_accumulation.py": 8, "test_bn_stats.py": 1, "test_copy.py": 30,
    "test_self_check.py": 280,  # 2026-12-02, on 2 cores that a CI run was sharing
}


def pytest_configure(config):
    """Every Python process the tests start imports tests/fast_exit/sitecustomize.py: at its exit it skips the
    interpreter's final garbage collections, about a CPU-second per process with torch loaded (its docstring).
    The processes inherit it through PYTHONPATH (support.python_path keeps it where a test sets its own;
    support.run_env's fast_exit=False leaves it out, for the runs that are a user's command as written)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != FAST_EXIT]
    os.environ["PYTHONPATH"] = os.pathsep.join([FAST_EXIT, *inherited])


def pytest_collection_modifyitems(items):
    def seconds(item):
        return FILE_SECONDS.get(os.path.basename(str(item.fspath)), float("inf"))
    items.sort(key=seconds, reverse=True)  # stable: each file's tests keep their order


@pytest.fixture(autouse=True)
def kill_leftovers():
    """A failed test must not leave torchrun and its ranks running into the next one."""
    yield
    while STARTED:
        kill_all(STARTED.pop())


@pytest.fixture(scope="session")
def learnable_dir(tmp_path_factory):
    """An extracted CIFAR-100-format dataset that a tiny WRN can learn."""
    d = tmp_path_factory.mktemp("learnable")
    write_cifar100(str(d), 3000, 500, archive=False)
    return str(d)


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory):
    """The out-dir of an uninterrupted CKPT_RUN on 2 ranks: what every stopped, killed or corrupted and then
    resumed run of it must end with, bit for bit (tests/e2e/test_resume.py, test_fault_tolerance.py,
    test_stop_signals.py, test_ddp_math.py's loaders); its metrics too (test_resume.py's exact resume). Read
    only."""
    return made_once(tmp_path_factory, "uninterrupted",
                     lambda folder: launch_forked([*CKPT_RUN, "--out-dir", folder / "run"], nproc=2)) / "run"


@pytest.fixture(scope="session")
def uninterrupted(uninterrupted_run):
    """The checkpoint of uninterrupted_run."""
    return load_model_state(uninterrupted_run)


@pytest.fixture(scope="session")
def uninterrupted_device_loader(tmp_path_factory):
    """The checkpoint of an uninterrupted CKPT_RUN on 2 ranks with the data device-resident (--loader gpu, on the
    CPU): the device loader batches the crop and flip with draws of its own, so its stopped runs end here."""
    return load_model_state(made_once(tmp_path_factory, "uninterrupted_device_loader", lambda folder: launch_forked(
        [*CKPT_RUN, "--loader", "gpu", "--out-dir", folder / "run"], nproc=2)) / "run")


@pytest.fixture(scope="session")
def accumulation_run(tmp_path_factory):
    """accumulation_run(ranks): the out-dir of an uninterrupted ACCUM_RUN on that many ranks (global
    batch 64, micro-batches of 16: 4 ranks x 1, 2 x 2, 1 x 4 accumulation steps), and its output;
    each run once per session (tests/e2e/test_accumulation.py, test_resume.py); 1 rank in the test's process
    (plain python: no process group, the same math). Read only."""
    def make(ranks, folder):
        args = [*ACCUM_RUN, "--out-dir", folder / "run"]
        proc = launch_forked(args, nproc=ranks) if ranks > 1 else run_in_process(args, check=True)
        (folder / "stdout").write_text(proc.stdout)

    def run(ranks):
        folder = made_once(tmp_path_factory, f"accumulation-w{ranks}", lambda f: make(ranks, f))
        return folder / "run", (folder / "stdout").read_text()
    return run


@pytest.fixture
def small_fs(tmp_path):
    """A 16 MiB tmpfs of the test's own: a filesystem that fills for real, with ENOSPC."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'mount failed'}): the full-disk tests need root")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)
