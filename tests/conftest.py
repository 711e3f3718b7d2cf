"""pytest's fixtures and hooks (the files' order), nothing else: the library the tests import is support.py.
This file puts the repository root (train_ddp.py and its modules) and tests/ (support.py) on sys.path, so
that `from support import ...` works from tests/unit/, tests/e2e/ and tests/gpu/ alike."""
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(TESTS), TESTS):  # the repository root, then tests/
    if path not in sys.path:
        sys.path.insert(0, path)

from support import (ACCUM_RUN, CKPT_RUN, STARTED, kill_all, launch_forked, load_model_state,  # noqa: E402
                     made_once, run_in_process, write_cifar100)


# The files that take longest, first (seconds on a fresh clone, 2026-11-26: the Slurm jobs 527, much of it
# waiting on Slurm's clock; adapt 279; training_run 189; on a slower machine 624, 472 and 364): the two
# pytest-xdist workers take files in this order, so these do not start last and leave one worker running alone
# at the end.
LONGEST_FIRST = ("test_slurm_jobs.py", "test_adapt.py", "test_training_run.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: each file's tests keep their order


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
