"""One run per out-dir: rank 0 holds `run.lock` while it trains; a dead run never locks out the next."""
from __future__ import annotations

import json
import os
import tempfile
import threading

from machinery.errors import UserError, WriteError, call_and_agree
from machinery.files import check_writable, describe_write_failure, now_iso
from machinery.launch import DistEnv, host_name
from machinery.output import log


class OutDirLock:
    """The out-dir belongs to one run at a time: rank 0 holds `run.lock`, touched every HEARTBEAT_S seconds.

    A second run refuses while the owner lives, and takes over when the owner's process is gone (same host), was an
    earlier run of the same Slurm job or torchrun (a requeue or restart ends it first), or has no heartbeat for STALE_S
    (its node died). link(2) is atomic on NFS, Lustre and GPFS too, and the owner re-reads the lock before each
    checkpoint, so even a mistaken takeover cannot let two runs write one checkpoint."""
    NAME, HEARTBEAT_S, STALE_S = "run.lock", 10.0, 60.0

    def __init__(self, out_dir: str):
        self.out_dir, self.path = out_dir, os.path.join(out_dir, self.NAME)
        self.me = {"host": host_name(), "pid": os.getpid(), "started": process_start(os.getpid()),
                   "slurm_job": os.environ.get("SLURM_JOB_ID"),
                   "torchrun": os.environ.get("TORCHELASTIC_RUN_ID"),
                   "token": os.urandom(8).hex(), "since": now_iso()}
        self.note, self._done = None, threading.Event()

    def acquire(self) -> "OutDirLock":
        for _ in range(5):
            tmp = f"{self.path}.{self.me['token']}"
            with open(tmp, "w") as f:
                json.dump(self.me, f)
            try:
                os.link(tmp, self.path)  # fails if the lock exists: no two runs can both succeed
                break
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
            holder, age = self._read(age=True)
            why_stale = self._why_stale(holder, age)
            if why_stale is None:
                raise UserError(f"--out-dir {self.out_dir} is in use by another run "
                                f"({describe_owner(holder)}, alive {age:.0f} s ago): wait for it to end or "
                                f"use another --out-dir (if that run is surely gone, delete {self.path})")
            self._break(holder)
            self.note = f"took over {self.path} from {describe_owner(holder)}: {why_stale}"
        else:
            raise UserError(f"could not take {self.path}: other runs keep taking it; use another --out-dir")
        threading.Thread(target=self._beat, name="out-dir heartbeat", daemon=True).start()
        return self

    def check(self) -> None:
        """Raise unless this run still owns the out-dir (called before each checkpoint)."""
        holder, _ = self._read()
        if holder is None:
            raise UserError(f"this run's lock {self.path} is gone (deleted, or --out-dir removed), so this "
                            f"run stops without writing there; if no other run uses {self.out_dir}, run the "
                            f"same command to resume")
        if holder.get("token") != self.me["token"]:
            raise UserError(f"another run took over --out-dir {self.out_dir} ({describe_owner(holder)}), so "
                            f"this one stops without writing there; run one job per out-dir")

    def release(self) -> None:
        self._done.set()
        holder, _ = self._read()
        if holder and holder.get("token") == self.me["token"]:
            try:
                os.unlink(self.path)
            except OSError:  # a filesystem turned read-only: the next run takes the lock over (its owner is gone)
                pass

    def _beat(self) -> None:
        while not self._done.wait(self.HEARTBEAT_S):
            try:
                holder, _ = self._read()
                if holder and holder.get("token") == self.me["token"]:
                    os.utime(self.path)
            except OSError:  # a filesystem hiccup: the next beat tries again
                pass

    def _read(self, age: bool = False):
        """The owner's record and, with `age`, its heartbeat's age by the file server's clock (a node's may differ)."""
        try:
            with open(self.path) as f:
                holder, mtime = json.load(f), os.fstat(f.fileno()).st_mtime
        except (OSError, ValueError):
            return None, 0.0
        if not age:
            return holder, 0.0
        with tempfile.NamedTemporaryFile(dir=self.out_dir, prefix=".clock-") as probe:
            now = os.fstat(probe.fileno()).st_mtime
        return holder, max(0.0, now - mtime)

    def _why_stale(self, holder, age: float) -> str | None:
        if holder is None:
            return "it was unreadable" if os.path.exists(self.path) else "it was just released"
        if holder["host"] == self.me["host"]:
            if process_start(holder["pid"]) != holder.get("started"):
                return f"its process {holder['pid']} is gone"
            return None  # alive on this very host: another run (or another step of this job)
        if self.me["slurm_job"] and holder.get("slurm_job") == self.me["slurm_job"]:
            return f"it was an earlier run of this Slurm job {self.me['slurm_job']} (requeued)"
        if self.me["torchrun"] not in (None, "none") and holder.get("torchrun") == self.me["torchrun"]:
            return "it was an earlier attempt of this torchrun job (restarted)"
        if age > self.STALE_S:
            return f"no heartbeat for {age:.0f} s (its node is gone)"
        return None

    def _break(self, holder) -> None:
        """Move the stale lock aside; of several runs racing for it, only one moves the same file."""
        aside = f"{self.path}.stale.{self.me['token']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            with open(aside) as f:
                moved = json.load(f)
        except (OSError, ValueError):
            moved = None
        if holder and moved and moved.get("token") != holder.get("token"):
            try:  # moved a fresh lock that another run had just taken: give it back
                os.link(aside, self.path)
            except FileExistsError:
                pass
        os.unlink(aside)


def process_start(pid: int):
    """The process's start time (clock ticks since boot), naming it with the pid even after pid reuse; None if there
    is no such process or it is a zombie (exited, waiting for its parent, or init after a kill -9, to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        try:
            os.kill(pid, 0)
            return 0  # alive, start time unknown (no /proc)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0


def describe_owner(holder) -> str:
    if not holder:
        return "unknown"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"host {holder['host']}, pid {holder['pid']}{job}, since {holder.get('since', '?')}"


def lock_out_dir(out_dir: str, env: DistEnv):
    """Rank 0 checks --out-dir is writable and locks it, or every rank raises why not; the lock on rank 0, else None."""
    def check_and_acquire():
        check_writable(out_dir)
        try:
            return OutDirLock(out_dir).acquire()
        except OSError as e:  # it was writable a moment ago: a full disk or quota, most likely
            raise WriteError(describe_write_failure(e, "the lock", out_dir)) from None

    lock = call_and_agree(check_and_acquire, here=env.is_main)  # one agreement for both steps
    if lock and lock.note:
        log(f"note: {lock.note}")
    return lock
