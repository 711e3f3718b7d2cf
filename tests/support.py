"""The tests' library (imported as `from support import ...`; conftest.py puts tests/ on sys.path):
launch the real entry points like a user, start them in the background and kill them, read their
records, and write CIFAR-100 archives in the exact python format. Fixtures live in conftest.py."""
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import torch

import forked_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
SCRIPTS = os.path.join("tests", "scripts")  # the launched helper scripts, relative to ROOT
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# A tiny WideResNet (WRN-10-1, 84k parameters) keeps CPU runs in seconds.
TINY = ["--depth", "10", "--widen-factor", "1", "--workers", "0", "--timeout", "120"]

# The run the resume and fault tests stop, kill or corrupt (and conftest's `uninterrupted` runs whole):
# 640 samples / 32 = 20 steps per epoch, a checkpoint every 4; dropout, so that the RNG state matters. No
# loader workers (a forkserver per rank and its workers add 2.7 s, 5 CPU-s, to a 2-rank launch): the tests
# whose point they are give --workers 1 or 2 (e2e/test_stop_signals.py: stopped mid-epoch, they end with this
# run's weights).
CKPT_RUN = ["--dataset", "synthetic", "--train-size", 640, "--test-size", 64, "--batch-size", 32,
            "--epochs", 2, "--dropout", 0.1, *TINY, "--checkpoint-every", 4]

# The accumulation runs (conftest's `accumulation_run`): 4 virtual ranks of 16, so 5 steps of 64 and a
# short one of 45 (micro-batches of 12, 11, 11, 11) per epoch; BatchNorm in train mode, no dropout.
# Runs that differ only in float summation order (threads, all-reduce vs local accumulation) drift
# apart chaotically at a high LR: at this one, on the learnable synthetic data, they stay within 2e-6
# of each other over 12 steps (0.2 gives 7e-4), where keeping every micro-step's BatchNorm statistics
# instead of micro-step 0's is 0.36 off (measured).
ACCUM_N_TRAIN = 365
ACCUM_RUN = ["--dataset", "synthetic", "--train-size", ACCUM_N_TRAIN, "--test-size", 50, "--batch-size", 64,
             "--epochs", 2, "--micro-batch", 16, "--base-lr", 0.1, "--warmup-epochs", 0.5, *TINY,
             "--device", "cpu"]


# The metrics a resume may change: the timings (each rank's split, a slow rank or a lagging loader named, the peak
# memory).
TIMING_METRICS = ("epoch_time_s", "eval_time_s", "train_time_s", "run_time_s", "images_per_s", "rank_times",
                  "slow_rank", "input_bound", "peak_memory_gib", "includes_start_up")


# tests/fast_exit, first on every launched process's PYTHONPATH (conftest's pytest_configure; run_env)
FAST_EXIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_exit")


def launch(args, nproc=1, torchrun=True, script="train_ddp.py", timeout=600, env=None, check=True, cwd=ROOT,
           fast_exit=True):
    """Run a script like a user: `torchrun --standalone --nproc_per_node=N script args`, or plain python,
    from `cwd` (the project directory unless told). fast_exit=False: the interpreter's own exit, as in a
    user's run (run_env), and check=True then also asserts that it was quiet: no finalizer's "Exception
    ignored", no abort at exit."""
    cmd = (TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}"] if torchrun else [sys.executable])
    cmd += [os.path.join(ROOT, script)] + [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=cwd, env=run_env(nproc, env, fast_exit=fast_exit), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    if check and not fast_exit:
        noise = [line for line in proc.stderr.splitlines()
                 if line.startswith("Exception ignored") or line.startswith("terminate called")]
        assert not noise, f"{' '.join(cmd)}: noise at exit\n{proc.stderr}"
    return proc


def launch_forked(args, nproc=2, script="train_ddp.py", timeout=600, env=None, check=True, cwd=ROOT):
    """launch(args, nproc) for a run whose point is the training (or its stop on request), not the launcher:
    the ranks get torchrun's environment and store but are forked from an interpreter that has imported torch
    already (forked_ranks.py), 15 CPU-seconds less per 2-rank run. Returns what launch() returns (the exit
    status torchrun's: 1 if a rank failed); `check`: raise if a rank failed."""
    script, argv = os.path.join(ROOT, script), [str(a) for a in args]
    codes, stdout, stderr = forked_ranks.run_ranks(script, argv, nproc=nproc, env=run_env(nproc, env),
                                                   cwd=cwd, timeout=timeout)
    proc = subprocess.CompletedProcess(["forked ranks", script, *argv], int(any(codes)), stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(argv)} on {nproc} forked ranks: exit codes {codes}\n"
                             f"{stdout}\n{stderr}")
    return proc


def run_in_process(args, env=None, check=False, script=None) -> subprocess.CompletedProcess:
    """`python train_ddp.py args` called in this process, as that command runs it (run_cli: the flags, main,
    the exit status), from the project directory, with the threads launch() gives one process: for one-process
    runs without loader workers whose point is not the process (a refusal, a short training whose records
    are read), where a fresh interpreter (3 CPU-seconds of imports) proves nothing more. Returns what
    launch() returns (returncode, stdout, stderr); `check`: raise if it failed, as launch() does; `script`: a
    copy of train_ddp.py to run instead (an adapted one: tests/e2e/test_adapt.py)."""
    import faulthandler
    import importlib.util
    import tempfile

    import train_utils
    from machinery.cli import run_cli
    if script is None:
        import train_ddp
    else:  # loaded under a name of its own: its functions, not train_ddp's
        name = f"adapted_{hashlib.md5(str(script).encode()).hexdigest()}"
        spec = importlib.util.spec_from_file_location(name, script)
        train_ddp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train_ddp)
    argv = [str(a) for a in args]
    workers = [a.split("=", 1)[1] if "=" in a else following
               for a, following in zip(argv, [*argv[1:], ""]) if a.split("=", 1)[0] == "--workers"]
    assert workers[-1:] == ["0"], "give --workers 0: loader workers need a process of their own (launch())"
    saved_env, saved_cwd, saved_threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    os.environ.update(env or {})
    os.chdir(ROOT)
    torch.set_num_threads(int(threads_per_rank(1)))
    # files, not StringIO: run_cli hands stderr's file descriptor to faulthandler
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                try:
                    status = run_cli(train_ddp.main, train_utils.get_args_parser(), train_utils.RECIPES,
                                     argv=argv)
                except SystemExit as e:  # argparse's refusals
                    status = e.code if isinstance(e.code, int) else 1
                status = 0 if status is None else status  # as sys.exit(None)
        finally:
            faulthandler.unregister(signal.SIGUSR2)  # run_cli's, on a file about to close
            torch.set_num_threads(saved_threads)
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
        stdout.seek(0)
        stderr.seek(0)
        proc = subprocess.CompletedProcess(["train_ddp.py", *argv], status, stdout.read(), stderr.read())
    if check and proc.returncode != 0:
        raise AssertionError(f"train_ddp.py {' '.join(argv)} (in this process) exited {proc.returncode}\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def made_once(tmp_path_factory, name: str, make):
    """The folder `name`, filled by make(folder) once for the whole test session: pytest-xdist's workers share
    it (the first to ask makes it, under a lock; the others wait and read), where a session fixture alone
    would launch the same reference run once per worker."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed making it
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


def run_env(nproc: int, env=None, fast_exit=True) -> dict:
    """The environment of every launched run (launch, launch_forked, start): this one, unbuffered output, the
    threads per rank, then the test's own variables; a PYTHONPATH of the test's goes before this one's.

    fast_exit=False leaves tests/fast_exit out: the interpreter's own exit, final garbage collections
    included, for the runs that are a user's command as written (the README's, the original script's
    lines, --compile, the GPU checks), so that what only those collections do still fails a test: a
    finalizer's "Exception ignored", or a DDP model left in a reference cycle until after its process group
    is gone, which can abort the process there (train_ddp.main collects before it destroys the group, and
    run_cli frees a bug's traceback at exit: e/test_write_failures.py and e/test_fault_tolerance.py check
    both with tests/scripts/teardown_probe.py)."""
    env = env or {}
    path = python_path(*([env["PYTHONPATH"]] if "PYTHONPATH" in env else []), fast_exit=fast_exit)
    merged = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads_per_rank(nproc), **env,
              "PYTHONPATH": path}
    if not path:
        del merged["PYTHONPATH"]
    return merged


def python_path(*folders, fast_exit=True) -> str:
    """PYTHONPATH for a process the test starts: `folders`, then the inherited one, which holds
    tests/fast_exit (conftest's pytest_configure: every process skips the interpreter's final garbage
    collections), left out with fast_exit=False."""
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(p for p in [*map(str, folders), *inherited] if p and (fast_exit or p != FAST_EXIT))


def threads_per_rank(nproc: int) -> str:
    """The thread count every launched run gets (launch and start alike), whatever the caller's environment:
    runs whose numbers are compared must sum in the same order. Each rank's share of the CPUs, which the
    other pytest-xdist workers' runs share too: more threads than cores make OpenMP's waiting threads spin
    against each other (single-process runs took 3 to 7 times as long, measured)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return str(max(1, (os.cpu_count() or 1) // (nproc * workers)))


def job_recipe() -> list:
    """RECIPE from jobs/lib.sh, as bash expands it: the arguments every job script puts first."""
    out = subprocess.run(["bash", "-c",
                          'PROJECT_DIR=. source jobs/lib.sh >/dev/null && printf "%s\\n" "${RECIPE[@]}"'],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def build_loaders(train, test, *, batch_size, rank, world_size, accum_steps, eval_batch, seed, workers,
                  pin_memory, device=None, skip_bad_samples=0, val=None, augment=None, spec=None):
    """dataset_utils.build_loaders from loose values, as the loader tests name them: (train, test), or (train,
    test, val) with `val`, with train_ddp.build_transforms'. Without `spec`, one stating the first image's shape
    (no augmentation beyond the crop and flip)."""
    import dataset_utils as du
    from types import SimpleNamespace
    if spec is None:
        first = train if train is not None else test
        shape = tuple(first.images.shape[1:]) if isinstance(first, du.ImageData) else tuple(first[0][0].shape)
        spec = du.DataSpec(*shape, num_classes=0, mean=(0.0,) * shape[0], std=(1.0,) * shape[0])
    flags = {**dict(auto_augment=None, random_erase=0.0, mixup_alpha=0.0, cutmix_alpha=0.0),
             **(augment or {})}
    cfg = SimpleNamespace(batch_size=batch_size, accumulation_steps=accum_steps, eval_batch=eval_batch,
                          seed=seed, num_workers=workers, skip_bad_samples=skip_bad_samples, loader="gpu", **flags)
    env = SimpleNamespace(rank=rank, world_size=world_size, cuda=pin_memory)
    data = SimpleNamespace(train=train, test=test, val=val, spec=spec, device=device, draws="")
    import train_ddp
    loaders = du.build_loaders(data, cfg, env, transforms=train_ddp.build_transforms(cfg, spec))
    return loaders if val is not None else loaders[:2]


def loaders_both_ways(data, *, rank, device, batch_size, eval_batch, epoch, start):
    """The (train, test) loaders of `data` on rank `rank` of 2, as DataLoaders and as DeviceLoaders on
    `device`, the training ones set to `epoch` from position `start`: ((torch_train, torch_test), (dev_train,
    dev_test))."""
    common = dict(batch_size=batch_size, rank=rank, world_size=2, accum_steps=1, eval_batch=eval_batch,
                  seed=5, workers=0, pin_memory=False)
    pairs = build_loaders(data, data, **common), build_loaders(data, data, **common, device=device)
    for train, _ in pairs:
        train.batch_sampler.set_epoch(epoch)
        train.batch_sampler.start_at(start)
    return pairs


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def read_json(path):
    with open(path) as f:
        return json.load(f)


def learnable_images(labels, rng, noise=24.0):
    """Class-dependent images: a colour and a grating per class, plus Gaussian noise."""
    classes = np.random.default_rng(1234)  # the same class patterns in train and test
    colour = classes.uniform(50, 205, size=(100, 3, 1, 1))
    freq = classes.integers(1, 4, size=(100, 2))
    phase = classes.uniform(0, 2 * np.pi, size=100)
    yy, xx = np.mgrid[0:32, 0:32]
    grating = np.stack([np.sin(2 * np.pi * (fx * xx + fy * yy) / 32 + p) for (fx, fy), p in zip(freq, phase)])
    imgs = (colour[labels] + 45 * grating[labels][:, None]
            + rng.normal(0, noise, size=(len(labels), 3, 32, 32)))
    return np.clip(imgs, 0, 255).astype(np.uint8)


def index_images(n):
    """Every pixel of image i encodes i (channel 0: i % 256, channel 1: i // 256), so a batch
    reveals which samples it holds whatever the crop and flip."""
    idx = np.arange(n)
    imgs = np.zeros((n, 3, 32, 32), dtype=np.uint8)
    imgs[:, 0] = (idx % 256)[:, None, None]
    imgs[:, 1] = (idx // 256)[:, None, None]
    return imgs


def write_cifar100(data_dir, n_train, n_test, kind="learnable", archive=True, seed=0, noise=24.0):
    """Write data_dir/cifar-100-python.tar.gz (and return its md5), in the layout and pickle format
    of the official archive: cifar-100-python/{train,test,meta}, dicts with 'data' (N, 3072) uint8
    rows in CHW order, 'fine_labels', 'coarse_labels', 'filenames' and 'batch_label'."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(data_dir, "cifar-100-python")
    os.makedirs(folder, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        labels = np.arange(n) % 100 if kind == "index" else rng.integers(0, 100, size=n)
        imgs = index_images(n) if kind == "index" else learnable_images(labels, rng, noise)
        entry = {"filenames": [f"img_{i}.png" for i in range(n)], "batch_label": f"{split} batch 1 of 1",
                 "fine_labels": [int(x) for x in labels], "coarse_labels": [int(x) // 5 for x in labels],
                 "data": imgs.reshape(n, 3072)}
        with open(os.path.join(folder, split), "wb") as f:
            pickle.dump(entry, f, protocol=2)  # the official files are protocol-2 pickles
    with open(os.path.join(folder, "meta"), "wb") as f:
        pickle.dump({"fine_label_names": [f"class_{i}" for i in range(100)],
                     "coarse_label_names": [f"super_{i}" for i in range(20)]}, f, protocol=2)
    if not archive:
        return None
    path = os.path.join(data_dir, "cifar-100-python.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(folder, arcname="cifar-100-python")
    for name in ("train", "test", "meta"):
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def load_model_state(out_dir):
    return torch.load(os.path.join(out_dir, "checkpoint.pt"), map_location="cpu", weights_only=True)


def assert_same_weights(out_dir, reference):
    """The run in out_dir ended where `reference` (a checkpoint) ended: the same epoch and position, and
    the same weights bit for bit."""
    got = load_model_state(out_dir)
    assert got["progress"]["epoch"] == reference["progress"]["epoch"]
    for k, v in reference["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["progress"]["position"] == reference["progress"]["position"]


def assert_close_models(a, b, tol=2e-4):
    """Two checkpoints' models agree to float tolerance (BN's counters exactly)."""
    for k, v in a["model"].items():
        if v.is_floating_point():
            assert torch.allclose(v, b["model"][k], atol=tol, rtol=tol), (k, (v - b["model"][k]).abs().max())
        else:
            assert torch.equal(v, b["model"][k]), k


STARTED = []  # processes start() launched: conftest's kill_leftovers ends them after each test


def kill_all(proc):
    """kill -9 of a launcher and its ranks (torchrun starts each rank in a session of its own); returns once
    each has exited (the ranks, whose launcher is gone, may stay zombies until init reaps them)."""
    launcher, *ranks = launcher_and_ranks(proc)
    for pid in [launcher, *ranks]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    wait_for(lambda: all(processes().get(pid, ("Z",))[0] in ("Z", "X") for pid in ranks), timeout=60,
             what="the killed ranks to exit")


def start(args, nproc=2, extra=(), env=None, torchrun=True, log=None, script="train_ddp.py"):
    """torchrun (or plain python) running `script` in the background, its output in a file (by default the
    out-dir's path + .log); returns (process, log path)."""
    log = str(log or os.path.join(str(args[args.index("--out-dir") + 1]) + ".log"))
    launcher = (TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", *extra] if torchrun
                else [sys.executable])
    cmd = launcher + [os.path.join(ROOT, script)]
    f = open(log, "w")
    proc = subprocess.Popen(cmd + [str(a) for a in args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            env=run_env(nproc, env), start_new_session=True)
    STARTED.append(proc)
    return proc, log


def launcher_and_ranks(proc):
    """The pids of a launcher start() started and of its ranks."""
    return [proc.pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                        text=True).stdout.split()]


def processes() -> dict:
    """{pid: (state, parent, session)} of every process."""
    table = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                state, ppid, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        table[int(stat.split("/")[2])] = (state, int(ppid), int(sid))
    return table


def command_line(pid: int) -> bytes:
    """The process's command line, NUL-separated as /proc keeps it; empty if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def children(pid: int) -> list:
    """The live processes whose parent is `pid`."""
    return [child for child, (state, ppid, _) in processes().items() if ppid == pid and state != "Z"]


def descendants(pid: int) -> list:
    """The live processes below `pid`: its children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def every_process(proc):
    """The pids of a launcher start() started and of every process below it (ranks, loader workers, resource
    trackers): what Slurm, `timeout` or a container runtime signal when they end a run."""
    return [proc.pid, *descendants(proc.pid)]


@contextlib.contextmanager
def paused(pids):
    """The processes `pids` (a training's launcher and ranks) stopped (SIGSTOP) while the block runs: what the
    block does (a stop file, a signal, a full disk) lands at a known point of training, however fast the
    machine."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            # gone meanwhile: Slurm's kill sends its own SIGCONT
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def wait_for(predicate, timeout=120, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def text(path):
    with open(path) as f:
        return f.read()


def fill(mount_point, leave: int):
    """Fill the filesystem but for `leave` bytes (rounded down to whole pages); returns the filler file."""
    filler = mount_point / "filler"
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(mount_point).free - leave))
    return filler


def assert_one_line(output, *parts):
    """The output holds exactly one `error: ` line (rank 0's), containing each part; no traceback of ours,
    and no timeout or lost rank after it (the cause, not a hang); returns the line."""
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output  # from rank 0 alone
    for part in parts:
        assert part in errors[0], errors[0]
    # no traceback of ours
    assert not re.search(r'(train_ddp|train_utils|dataset_utils|machinery/\w+)\.py", line', output)
    assert "timed out" not in output and "lost another rank" not in output  # the cause, not a hang after it
    return errors[0]


def torchrun_root_cause(output: str) -> str:
    """What torchrun's failure report gives as the root cause's reason (its `traceback :` line, the rank's
    error file), or "" when the report has none."""
    report = output.rpartition("Root Cause (first observed failure):")[2]
    found = re.search(r"^\s*traceback\s*:\s*(.*)$", report, re.M)
    return found.group(1) if found else ""


def require_package(name):
    """Skip the test if `name` cannot be imported, with the way to install it; in CI (CI=true, as .ci/run
    sets it) fail instead: the test extra installs it, so a skip there would hide a path CI must run."""
    import importlib.util
    if importlib.util.find_spec(name) is None:
        hint = f"{name} is not installed: pip install -e '.[test]'"
        if os.environ.get("CI") == "true":
            raise AssertionError(hint)
        import pytest
        pytest.skip(hint)
