"""Ranks forked from an interpreter that has imported torch once per test worker, for the runs whose point is
the training, not the launcher (support.launch_forked). torchrun starts each rank as a fresh interpreter that
imports torch and torch._dynamo (about 5 CPU-seconds a rank on a slow 2-core machine, more than a tiny run's
training) and tears it down at the end (another second): a 2-rank tiny run took 20.6 CPU-seconds under
torchrun, 6 forked here (measured by tests/launch_cost.py).

What a rank sees is what torchrun --standalone gives it: torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
the run id, restart 0), its agent store (hosted here, as torchrun's agent hosts it, so that the ranks meet
the way they do under torchrun), stdout and stderr shared by the ranks, the script run as __main__ from the
given directory with sys.argv, sys.path and the environment a fresh interpreter would have, and at the end
what the interpreter does at exit (the non-daemon threads joined, the atexit handlers run), without its
teardown. Each rank leads a session of its own, as under torchrun, and a rank that fails ends the others'
sessions (SIGTERM, then SIGKILL after 30 s). What a fork cannot give: the ranks share the forkserver's string
hash seed, and what the interpreter and torch read from the environment at their start is the forkserver's
(such variables are refused). It is not torchrun: tests of the launcher itself (a stop signal, a restart, a
lost node, how a failing rank ends the others) launch torchrun (support.launch and support.start)."""
from __future__ import annotations

import atexit
import ctypes
import functools
import io
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import torch.distributed as dist

# What every rank imports first, the bulk of its start-up; read by the forkserver once. The project's own
# modules are not among them: some read the environment when imported (machinery/cifar_archive.py).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed"]

# Read when the interpreter or torch starts, so the forkserver's values would hold, not the test's: such runs
# must be launched (support.launch).
READ_AT_START = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_", "CUDA_", "LD_")
SET_PER_RUN = ("PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS")


_preloaded_server = {"pid": None}  # the forkserver that forked_context started with PRELOAD


def forked_context():
    """multiprocessing's forkserver, running with PRELOAD imported (restarted with it if something in this
    process started it without: a DataLoader here, whose workers' preload is the recipe's own)."""
    server = multiprocessing.forkserver._forkserver
    server.set_forkserver_preload(PRELOAD)  # a DataLoader here sets its own list each time
    if server._forkserver_pid is not None and server._forkserver_pid != _preloaded_server["pid"]:
        server._stop()  # started by a DataLoader here: torch at most, not all of PRELOAD
    server.ensure_running()  # (re)started with PRELOAD if it is not running
    _preloaded_server["pid"] = server._forkserver_pid
    return multiprocessing.get_context("forkserver")


@functools.cache
def fresh_sys_path() -> tuple:
    """sys.path of `python script.py` without its first entry (the script's folder): the standard library,
    site-packages and what their .pth files add; read once."""
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout
    return tuple(json.loads(out))


def run_ranks(script: str, argv: list, *, nproc: int, env: dict, cwd: str, timeout: float):
    """Run `script argv` on nproc forked ranks; returns (exit codes by rank, stdout, stderr). A rank that
    fails ends the others, as torchrun does; at the timeout, every rank is killed and
    subprocess.TimeoutExpired raised, as subprocess.run does."""
    given = [k for k in env if k.startswith(READ_AT_START) and k not in SET_PER_RUN
             and os.environ.get(k) != env[k]]
    if given:
        raise ValueError(f"{', '.join(given)}: read when the interpreter or torch starts, so a forked rank "
                         f"would not see it; launch this run with torchrun (support.launch)")
    context = forked_context()
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # torchrun's agent store
    torchrun = {"LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "localhost", "MASTER_PORT": str(store.port), "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": str(uuid.uuid4()),
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}
    ranks = []
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out, err):
            open(path, "w").close()
        try:
            for rank in range(nproc):
                rank_env = {**env, **torchrun, "RANK": str(rank), "LOCAL_RANK": str(rank),
                            "ROLE_RANK": str(rank)}
                process = context.Process(target=run_rank, name=f"rank {rank}", args=(
                    script, argv, rank_env, cwd, out, err, fresh_sys_path()))
                process.start()
                ranks.append(process)
            finished = wait_for_ranks(ranks, timeout=timeout)
        finally:
            signal_sessions([r for r in ranks if r.exitcode is None], signal.SIGKILL)
            for rank in ranks:
                rank.join()
            del store
        with open(out, errors="replace") as f, open(err, errors="replace") as g:
            stdout, stderr = f.read(), g.read()
    if not finished:  # as subprocess.run: the output so far with it
        raise subprocess.TimeoutExpired([script, *argv], timeout, output=stdout, stderr=stderr)
    return [rank.exitcode for rank in ranks], stdout, stderr


def signal_sessions(ranks, signum) -> None:
    """`signum` to each rank's session: the rank, its loader workers, their forkserver and its resource
    tracker, as torchrun ends a rank (os.killpg)."""
    for rank in ranks:
        try:
            os.killpg(rank.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def wait_for_ranks(ranks, *, timeout: float) -> bool:
    """Until every rank has exited, or one failed and the others were given SIGTERM and up to 30 s to exit
    (then the caller's SIGKILL), as torchrun does: True; False at the timeout."""
    deadline = time.monotonic() + timeout
    while (running := [r for r in ranks if r.exitcode is None]):
        if any(r.exitcode for r in ranks):
            signal_sessions(running, signal.SIGTERM)
            grace = time.monotonic() + 30
            while (running := [r for r in running if r.exitcode is None]) and time.monotonic() < grace:
                multiprocessing.connection.wait([r.sentinel for r in running],
                                                timeout=grace - time.monotonic())
            return True
        if (left := deadline - time.monotonic()) <= 0:
            return False
        multiprocessing.connection.wait([r.sentinel for r in running], timeout=left)
    return True


def run_rank(script, argv, env, cwd, stdout_path, stderr_path, base_path) -> None:
    """In the forked rank: become what a fresh `python script argv` would be, run it, exit as it would."""
    # multiprocessing's view: a main process with no parent, which starts its own resource tracker and its
    # own forkserver (for its loader workers), as a rank under torchrun does; not the test worker's
    os.setsid()  # a session of its own, as torchrun starts each rank
    me = multiprocessing.current_process()
    me._name, me._identity, me._parent_pid = "MainProcess", (), None
    me._config.pop("tempdir", None)  # its own pymp- folder, not the test worker's
    multiprocessing.process._parent_process = None
    multiprocessing.context._default_context._actual_context = None  # the default start method again
    tracker = multiprocessing.resource_tracker._resource_tracker
    server = multiprocessing.forkserver._forkserver
    tracker._fd = tracker._pid = None
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server._inherited_fds = None
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout_path), (2, stderr_path)):  # O_APPEND: the ranks' lines interleave, whole
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    encoding, errors = sys.__stdout__.encoding, sys.__stdout__.errors  # the interpreter's, for this locale
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), encoding=encoding, errors=errors,
                                  write_through=True)  # python -u
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), encoding=encoding,
                                  errors="backslashreplace", write_through=True)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a fresh interpreter's signals, whatever the forkserver's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)),
                   *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *base_path]
    import torch
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # OpenMP read the forkserver's, at its import
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # as the interpreter ends on it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter: the frames kept (sys.last_*) while the exit handlers run
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what the interpreter does at exit, in its order: the non-daemon threads,
    atexit._run_exitfuncs()  # then the atexit handlers
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    ctypes.CDLL(None).fflush(None)  # C's buffered stdout (a library's own prints), which os._exit drops
    os._exit(code)
