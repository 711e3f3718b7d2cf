"""Where a tiny test launch's seconds go: `python tests/launch_cost.py [--repeats 3]` times, from the
project directory, each layer a test's launch adds (the interpreter, torch's import, the project's modules,
the run under plain python, under torchrun on 2 ranks, one more epoch, loader workers; and the same 2-rank
run on ranks forked from a warm forkserver, as support.launch_forked starts them), median of the
repeats, one layer per line: wall seconds, and CPU seconds (the machine's busy time during the command, from
/proc/stat: every process it starts, loader workers whose parent is not the command's included; so run it
on an idle machine), which is what the suite's two files at a time share. Not a test: a measurement for
tests/README.md; it asserts nothing."""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from support import ROOT, TINY, TORCHRUN, launch_forked, threads_per_rank

# The suite's tiny run (support.TINY on generated data): 128 images in steps of 32, 64 scored.
RUN = ["train_ddp.py", "--dataset", "synthetic", "--train-size", "128", "--test-size", "64",
       "--batch-size", "32", *TINY, "--device", "cpu", "--log-every", "0"]


def busy_seconds() -> float:
    """The CPU seconds the machine has spent busy (all CPUs; every state but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def seconds(cmd, repeats):
    """The median wall and CPU seconds of `cmd` run from the project directory, each in a fresh out-dir, with
    the threads per rank the suite's launches give (support.threads_per_rank)."""
    threads = threads_per_rank(2 if "--nproc_per_node=2" in cmd else 1)
    times, cpus = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            full = [a.replace("OUT", out) for a in cmd]
            start, busy = time.perf_counter(), busy_seconds()
            proc = subprocess.run(full, cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": threads})
            if proc.returncode != 0:
                sys.exit(f"{' '.join(full)} exited {proc.returncode}:\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
            times.append(time.perf_counter() - start)
            cpus.append(busy_seconds() - busy)
    return statistics.median(times), statistics.median(cpus)


def forked_seconds(args, repeats):
    """The median wall and CPU seconds of support.launch_forked(args, nproc=2), each in a fresh out-dir, after
    one untimed run that starts its forkserver (the suite starts one per test worker)."""
    def once():
        with tempfile.TemporaryDirectory() as out:
            start, busy = time.perf_counter(), busy_seconds()
            launch_forked([a.replace("OUT", out) for a in args], nproc=2)
            return time.perf_counter() - start, busy_seconds() - busy
    once()
    times, cpus = zip(*(once() for _ in range(repeats)))
    return statistics.median(times), statistics.median(cpus)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command; the median is shown")
    n = parser.parse_args().repeats
    py = [sys.executable]

    def run(epochs=1, workers=0):
        return [*RUN, "--epochs", str(epochs), "--workers", str(workers), "--out-dir", "OUT"]
    two = [*TORCHRUN, "--standalone", "--nproc_per_node=2"]
    # (what, how it is timed, the command or the forked ranks' arguments, the line it adds to)
    layers = [
        ("the interpreter", seconds, [*py, "-c", "pass"], None),
        ("import torch", seconds, [*py, "-c", "import torch"], "the interpreter"),
        ("import train_ddp (the project's modules)", seconds, [*py, "-c", "import train_ddp"],
         "import torch"),
        ("1 epoch under plain python", seconds, [*py, *run()], "import train_ddp (the project's modules)"),
        ("1 epoch under torchrun, 2 ranks", seconds, [*two, *run()], "1 epoch under plain python"),
        ("2 epochs under torchrun, 2 ranks", seconds, [*two, *run(epochs=2)],
         "1 epoch under torchrun, 2 ranks"),
        ("1 epoch, 2 ranks, a loader worker per loader", seconds, [*two, *run(workers=1)],
         "1 epoch under torchrun, 2 ranks"),
        ("1 epoch, 2 ranks forked (launch_forked)", forked_seconds, run()[1:],
         "1 epoch under torchrun, 2 ranks"),
    ]
    measured = {}
    print(f"{os.cpu_count()} CPUs, median of {n} runs: wall s, CPU s (+ what the line adds to the one named)")
    for name, timed, cmd, base in layers:
        wall, cpu = measured[name] = timed(cmd, n)
        added = (f"  (+{wall - measured[base][0]:.2f}, +{cpu - measured[base][1]:.2f} on '{base}')"
                 if base else "")
        print(f"{wall:7.2f} {cpu:7.2f}  {name}{added}", flush=True)


if __name__ == "__main__":
    main()
