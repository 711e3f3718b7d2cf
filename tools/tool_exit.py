"""The tools' (bench.py, preflight.py, plot.py) way out: SIGTERM (a timeout, scancel, torchrun) and Ctrl-C end
them at once in one line, and a UserError is one `error:` line and exit status 2. train_ddp.py instead turns
the stop signals into a checkpointed stop (machinery/signals.py: StopRequest); nothing here is imported by it."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from torch.distributed.elastic.multiprocessing.errors import record

from machinery.cli import parse_flags  # and with it, a bug's traceback freed at exit (bench.py's DDP model)
from machinery.errors import UserError
from machinery.launch import read_dist_env
from machinery.output import log, report_to_launcher
from machinery.signals import quiet_resource_tracker


def run_tool(main, parser, recipes: dict | None = None) -> int:
    """The tools' entry point (bench.py, preflight.py): SIGTERM and Ctrl-C end them at once in one line
    (catch_stop_signals), and a UserError is one `error:` line from rank 0 and exit status 2. With
    `recipes`, --recipe NAME's preset sits under the flags given, as in training (parse_flags). Returns
    main(args)'s status (None: 0)."""
    catch_stop_signals()
    try:
        args = parser.parse_args() if recipes is None else parse_flags(parser, recipes, sys.argv[1:])[0]
        return record(main)(args) or 0
    except UserError as e:
        log(f"error: {e}", file=sys.stderr)
        report_to_launcher(f"error: {e}")
        return 2


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM (timeout, scancel, torchrun) or SIGINT (Ctrl-C), raised in the main thread."""


_stop = {"signum": None, "lock": threading.Lock(), "exiting": False}


def catch_stop_signals(grace_s: float = 1.5) -> None:
    """SIGTERM and SIGINT raise StoppedBySignal in the main thread at its next Python instruction; once it (or
    whatever it became on the way out) leaves the script, sys.excepthook ends the process with one line and
    exit status 128 + signum (exit_stopped), after the `finally` blocks on the way (the process group, the
    DataLoader workers). A thread woken by the signal itself (signal.set_wakeup_fd) ends it the same way after
    `grace_s` if the main thread is held up, e.g. in a C call that waits for a peer which has already left.
    Forked processes (DataLoader workers) get the default handling back."""
    quiet_resource_tracker()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def on_signal(signum, frame):
        if _stop["signum"] is None:  # a second signal changes nothing: the thread below ends the process
            _stop["signum"] = signum
            # no DataLoader "worker killed" error on the way out
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            raise StoppedBySignal(signum)

    def backstop():
        while not (got := [s for s in os.read(read_fd, 64) if s in (signal.SIGTERM, signal.SIGINT)]):
            pass
        time.sleep(grace_s)
        exit_stopped(got[0], flush=False)  # the main thread may hold stdout's lock

    def in_child():
        with contextlib.suppress(ValueError):  # raised if not the main thread
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def excepthook(kind, value, tb, default=sys.excepthook):
        if _stop["signum"] is not None:
            exit_stopped(_stop["signum"])
        default(kind, value, tb)

    # a signal that lands in a __del__ is lost: the thread ends it
    def unraisable(info, default=sys.unraisablehook):
        if not isinstance(info.exc_value, StoppedBySignal):
            default(info)

    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    sys.excepthook, sys.unraisablehook = excepthook, unraisable

    def hold_forks():  # a thread starting a DataLoader worker while exit_stopped runs waits for the exit instead
        if _stop["exiting"]:
            _stop["lock"].acquire()

    os.register_at_fork(before=hold_forks, after_in_child=in_child)
    threading.Thread(target=backstop, name="stop-backstop", daemon=True).start()


def exit_stopped(signum: int, flush: bool = True) -> None:
    """`script: [rank r: ]stopped by SIGTERM` on stderr, once, then exit 128 + signum at once."""
    # the main thread or the backstop, whichever comes first; the other waits here for the exit
    with _stop["lock"]:
        for stream in (sys.stdout, sys.stderr) if flush else ():
            with contextlib.suppress(Exception):
                stream.flush()
        env = read_dist_env()
        rank = f"rank {env.rank}: " if env.world_size > 1 else ""
        os.write(2, (f"{os.path.basename(sys.argv[0])}: {rank}stopped by "
                     f"{signal.Signals(signum).name}\n").encode())
        # DataLoader workers still up would outlive this process by seconds (until their 5 s check of their parent);
        # the main thread may be starting one now (the signal arrived in another thread while it held them): no
        # fork from here on (hold_forks), and the forks not yet registered with multiprocessing are found too.
        _stop["exiting"] = True
        mp = sys.modules.get("multiprocessing")
        children = mp.active_children() if mp else []
        for child in children:  # SIGKILL: the loader workers ignore SIGTERM (deaf_to_stop_signals)
            with contextlib.suppress(Exception):
                child.kill()
        kill_forks()
        for child in children:  # gone before we are, so nothing of ours outlives the exit line
            with contextlib.suppress(Exception):
                child.join(timeout=1.0)
        kill_forks()  # one whose fork was under way at the first look
        os._exit(128 + signum)


def kill_forks() -> None:
    """SIGKILL this process's children that are forks of it (their command line its own: DataLoader workers of the
    fork context, whether multiprocessing has registered them yet or not). Linux's /proc; elsewhere nothing."""
    def command_line(pid) -> bytes:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    with contextlib.suppress(OSError):
        me, mine = os.getpid(), command_line(os.getpid())
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                if parent == me and command_line(entry) == mine:
                    os.kill(int(entry), signal.SIGKILL)
