"""SIGTERM (timeout, scancel, torchrun) and Ctrl-C stop the tools at once: bench.py, preflight.py and plot.py,
each launched for real, stopped while it works, leave within a few seconds with exit status 128 + signum,
one line on stderr and no traceback; under torchrun every rank does, and a Ctrl-C to the whole process
group (the terminal's) leaves no DataLoader worker behind.

Each test waits for a sign that the script is where it should be hit: a line it prints, a port it
listens on, or, where it prints nothing first, its handler installed (the SIGTERM bit of SigCgt in
/proc/PID/status) and its work begun; the work is made far longer than the wait, so the signal always
lands while it runs. The launch code is written out here; the process table (processes, children, descendants)
comes from support.py, shared with test_stop_signals.py."""
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from support import children, command_line, descendants, processes, python_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": python_path(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
SMALL_BENCH = ["--device", "cpu", "--depth", 10, "--widen-factor", 1, "--batch-size", 32]
# the scripts' own limit is 1.5 s after the signal; the rest is slack for a loaded machine
EXIT_WITHIN_S = 5.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


class Launched:
    """A script started in its own session, its stdout and stderr going to files in `folder`."""

    def __init__(self, cmd, folder, env=None):
        self.out_path, self.err_path = folder / "stdout.txt", folder / "stderr.txt"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([str(c) for c in cmd], cwd=folder, env={**ENV, **(env or {})},
                                         stdout=out, stderr=err, start_new_session=True)
        self.pid = self.proc.pid

    def output(self) -> tuple:
        with open(self.out_path) as out, open(self.err_path) as err:
            return out.read(), err.read()

    def wait_until(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"exited {self.proc.returncode} before {what}:\n" + "\n".join(self.output()))
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout} s:\n" + "\n".join(self.output()))
            time.sleep(0.05)

    def printed(self, text: str, path=None) -> bool:
        with open(path or self.out_path) as f:
            return text in f.read()

    def signal(self, sig, group: bool = False) -> tuple:
        """Send `sig` (to the whole process group, as a terminal's Ctrl-C does, if `group`); returns
        (exit status, seconds to exit)."""
        t = time.monotonic()
        (os.killpg if group else os.kill)(self.pid, sig)
        try:
            code = self.proc.wait(timeout=EXIT_WITHIN_S + 20)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - t

    def kill_all(self) -> None:
        """After a failure: SIGKILL the script and everything it started (torchrun's ranks have sessions of
        their own)."""
        for pid in [self.pid, *descendants(self.pid), *session_members(self.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


@pytest.fixture
def launched():
    started = []

    def start(cmd, folder, env=None):
        started.append(Launched(cmd, folder, env))
        return started[-1]
    yield start
    for p in started:
        p.kill_all()


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (the SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(int(mask, 16) >> (sig - 1) & 1)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def session_members(sid: int) -> list:
    """The live processes of session `sid` (the launched script and whatever it started)."""
    return [pid for pid, (state, _, s) in processes().items() if s == sid and state != "Z"]


def dataloader_workers(pid: int) -> int:
    """How many DataLoader workers process `pid` has: forked from it (the fork start method, the original
    script's pipeline's: they keep its command line) or from its forkserver (the project's loaders')."""
    table = processes()
    live = {q: parent for q, (state, parent, _) in table.items() if state != "Z"}
    forkservers = {q for q, parent in live.items()
                   if parent == pid and b"multiprocessing.forkserver" in command_line(q)}
    own = command_line(pid)
    return sum(1 for q, parent in live.items()
               if parent in forkservers or (parent == pid and command_line(q) == own))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether some process listens on TCP `port` (state 0A in /proc/net/tcp or tcp6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            if any(row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "0A" for row in list(f)[1:]):
                return True
    return False


def assert_stopped(p: Launched, code, seconds: float, sig, line: str) -> None:
    out, err = p.output()
    assert code == 128 + sig, f"exit status {code} after {seconds:.1f} s, not {128 + sig}:\n{out}\n{err}"
    assert seconds < EXIT_WITHIN_S, f"took {seconds:.1f} s to exit"
    assert "Traceback" not in out + err, out + err
    assert err.strip().splitlines()[-1:] == [line] and err.count("stopped by") == 1, err


def wait_for_no_members(p: Launched) -> list:
    """What of the script's session outlives it. Its DataLoader workers (and their forkserver), which it ends
    before its exit line, must be gone within 4 s: left behind, they would notice their parent's death only at
    their next 5 s check. multiprocessing's resource tracker leaves on its own once every holder of its pipe is
    gone, after its clean-up, which a loaded machine may take seconds to schedule: it has 60 s."""
    def members() -> dict:
        found = {}
        for pid in session_members(p.pid):
            try:
                found[pid] = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:200]
            except OSError:  # gone meanwhile
                pass
        return found

    def left(allow_tracker: bool) -> list:
        return [(pid, cmd) for pid, cmd in members().items()
                if not (allow_tracker and "multiprocessing.resource_tracker" in cmd)]
    for allow_tracker, seconds in ((True, 4.0), (False, 60.0)):
        deadline = time.monotonic() + seconds
        while left(allow_tracker) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left(allow_tracker):
            return left(allow_tracker)
    return []


def test_bench_stops_at_once_on_sigterm_in_the_timed_steps(launched, tmp_path):
    """SIGTERM to bench.py alone (`kill PID`), in the recipe's steps fed by a DataLoader (--loader torch),
    whose persistent workers it takes down with it."""
    p = launched([sys.executable, f"{ROOT}/bench.py", *SMALL_BENCH, "--loader", "torch", "--workers", 2,
                  "--steps", 100_000, "--warmup", 1, "--json", tmp_path / "b.json"], tmp_path)
    p.wait_until(lambda: p.printed("timing the recipe's step"), "timing line")
    p.wait_until(lambda: dataloader_workers(p.pid) >= 2, "two DataLoader workers")
    p.wait_until(lambda: p.printed("the timed steps begin"), "the timed steps")
    code, seconds = p.signal(signal.SIGTERM)
    assert_stopped(p, code, seconds, signal.SIGTERM, "bench.py: stopped by SIGTERM")
    assert not (tmp_path / "b.json").exists()
    assert wait_for_no_members(p) == []


def test_bench_stops_on_ctrl_c_with_its_dataloader_workers(launched, tmp_path):
    """Ctrl-C reaches the whole process group: bench.py and the original pipeline's DataLoader workers.
    None prints a traceback, and none is left behind."""
    p = launched([sys.executable, f"{ROOT}/bench.py", *SMALL_BENCH, "--steps", 40, "--warmup", 1,
                  "--compare-original", "--workers", 2, "--json", tmp_path / "b.json"], tmp_path)
    p.wait_until(lambda: p.printed("timing the original script's pipeline"),
                 "the original pipeline's line", 120)
    p.wait_until(lambda: dataloader_workers(p.pid) >= 2, "two DataLoader workers")
    code, seconds = p.signal(signal.SIGINT, group=True)
    assert_stopped(p, code, seconds, signal.SIGINT, "bench.py: stopped by SIGINT")
    assert wait_for_no_members(p) == []


def test_bench_under_torchrun_every_rank_stops_on_sigterm(launched, tmp_path):
    """torchrun passes SIGTERM on to its ranks: each says so in one line and leaves; torchrun then exits
    non-zero (with a traceback of its own SignalException, which is torchrun's: the ranks' output, in
    their own files here, has none)."""
    logs = tmp_path / "logs"
    p = launched([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  "--log-dir", logs, "--redirects", "3", f"{ROOT}/bench.py", *SMALL_BENCH, "--steps", 100_000,
                  "--warmup", 1, "--json", tmp_path / "b.json"], tmp_path)

    def rank_file(rank, name):
        found = glob.glob(f"{logs}/*/attempt_0/{rank}/{name}.log")
        return found[0] if found else None

    p.wait_until(lambda: (rank_file(0, "stdout")
                          and p.printed("timing the recipe's step", rank_file(0, "stdout"))),
                 "rank 0's timing line", 90)
    ranks = children(p.pid)
    assert len(ranks) == 2 and all(catches(r, signal.SIGTERM) for r in ranks)
    p.wait_until(lambda: p.printed("the timed steps begin", rank_file(0, "stdout")),
                 "rank 0's timed steps", 90)
    code, seconds = p.signal(signal.SIGTERM)
    assert code not in (None, 0) and seconds < EXIT_WITHIN_S, (code, seconds, p.output())
    assert not any(alive(r) for r in ranks)
    for rank in (0, 1):
        with open(rank_file(rank, "stderr")) as f:
            err = f.read()
        assert "Traceback" not in err, err
        assert (re.findall(r"^bench\.py: .*stopped by .*$", err, re.M)
                == [f"bench.py: rank {rank}: stopped by SIGTERM"])


def test_preflight_stops_on_sigterm_while_a_c_call_waits_for_a_rank_that_never_comes(launched, tmp_path):
    """Rank 0 of two, alone: it waits in the rendezvous (C++, where no Python signal handler runs) for rank 1.
    The script's backstop thread, woken by the signal itself, ends it all the same."""
    port = free_port()
    ranks = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    p = launched([sys.executable, f"{ROOT}/preflight.py", "--dataset", "synthetic",
                  "--out-dir", tmp_path / "out", "--device", "cpu", "--timeout", 120], tmp_path, env=ranks)
    # The store listens from inside init_process_group, which then waits in C++ for rank 1: the event itself.
    p.wait_until(lambda: listening(port), f"the rendezvous store on port {port}")
    code, seconds = p.signal(signal.SIGTERM)
    assert_stopped(p, code, seconds, signal.SIGTERM, "preflight.py: rank 0: stopped by SIGTERM")


def test_preflight_network_check_stops_on_ctrl_c_while_it_waits_for_nodes(launched, tmp_path):
    """--network on the first of two nodes listens for the other one for up to --timeout: a blocking
    accept, which Ctrl-C ends at once."""
    port = free_port()
    slurm = {"SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURMD_NODENAME": "node0"}
    p = launched([sys.executable, f"{ROOT}/preflight.py", "--network", f"127.0.0.1:{port}", "--timeout", 120],
                 tmp_path, env=slurm)
    p.wait_until(lambda: listening(port), f"a listener on port {port}")
    code, seconds = p.signal(signal.SIGINT, group=True)
    assert_stopped(p, code, seconds, signal.SIGINT, "preflight.py: stopped by SIGINT")


def test_plot_stops_on_sigterm_while_it_plots(launched, tmp_path):
    """Ten runs of 100,000 epochs each take plot.py half a minute or more: it is stopped once matplotlib
    is loaded (its handler, installed first, long in place)."""
    pytest.importorskip("matplotlib")
    rows = "".join(f'{{"epoch": {i}, "train_loss": 1.0, "val_loss": 1.0, "val_acc": 0.5, "val_top5": 0.8, '
                   f'"images_per_s": 100.0}}\n' for i in range(1, 100_001))
    (tmp_path / "metrics.jsonl").write_text(rows)
    runs = []
    for k in range(10):
        (tmp_path / f"run{k}").mkdir()
        os.symlink(tmp_path / "metrics.jsonl", tmp_path / f"run{k}" / "metrics.jsonl")
        runs.append(tmp_path / f"run{k}")
    p = launched([sys.executable, f"{ROOT}/plot.py", *runs, "--out", tmp_path / "plots"], tmp_path)

    def matplotlib_loaded():
        with open(f"/proc/{p.pid}/maps") as f:
            return "matplotlib" in f.read()
    p.wait_until(matplotlib_loaded, "matplotlib loaded", 60)
    assert catches(p.pid, signal.SIGTERM)
    code, seconds = p.signal(signal.SIGTERM)
    assert_stopped(p, code, seconds, signal.SIGTERM, "plot.py: stopped by SIGTERM")
    # the last of the three: it had not got there
    assert not os.path.exists(tmp_path / "plots" / "throughput.png")
