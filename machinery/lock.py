"""One run per out-dir: rank 0 holds `run.lock` while it trains; a dead run never locks out the next."""

import json
import os
import tempfile
import threading
from contextlib import suppress

from machinery.errors import UserError, WriteError, call_and_agree
from machinery.files import check_writable, describe_write_failure, now_iso
from machinery.launch import DistEnv, host_name
from machinery.output import log


class OutDirLock:
    """Taken over once its owner's process is gone (same host), it is this job's earlier attempt, or its beat stops."""
    NAME, HEARTBEAT_S, STALE_S = "run.lock", 10.0, 60.0

    def __init__(self, out_dir: str):
        self.out_dir, self.path = out_dir, os.path.join(out_dir, self.NAME)
        self.me = {"host": host_name(), "pid": os.getpid(), "started": process_start(os.getpid()),
                   "slurm_job": os.environ.get("SLURM_JOB_ID"), "torchrun": os.environ.get("TORCHELASTIC_RUN_ID"),
                   "token": os.urandom(8).hex(), "since": now_iso()}
        self.note, self._done = None, threading.Event()

    def acquire(self) -> "OutDirLock":
        tmp = f"{self.path}.{self.me['token']}"
        for _ in range(5):
            with open(tmp, "w") as f:
                json.dump(self.me, f)
            try:
                with suppress(FileExistsError):
                    os.link(tmp, self.path)  # atomic: of two runs, one succeeds
                    break
            finally:
                os.unlink(tmp)
            holder, mtime = self._read()
            with tempfile.NamedTemporaryFile(dir=self.out_dir, prefix=".clock-") as probe:
                age = max(0.0, os.fstat(probe.fileno()).st_mtime - mtime)  # the file server's clock, not a node's
            if holder is None:
                why = "it was unreadable" if os.path.exists(self.path) else "it was just released"
            elif holder["host"] == self.me["host"]:  # alive on this host: another run, or another step of this job
                gone = process_start(holder["pid"]) != holder.get("started")
                why = f"its process {holder['pid']} is gone" if gone else None
            elif self.me["slurm_job"] and holder.get("slurm_job") == self.me["slurm_job"]:
                why = f"it was an earlier run of this Slurm job {self.me['slurm_job']} (requeued)"
            elif self.me["torchrun"] not in (None, "none") and holder.get("torchrun") == self.me["torchrun"]:
                why = "it was an earlier attempt of this torchrun job (restarted)"
            else:
                why = f"no heartbeat for {age:.0f} s (its node is gone)" if age > self.STALE_S else None
            if why is None:
                raise UserError(f"--out-dir {self.out_dir} is in use by another run ({describe_owner(holder)}, "
                                f"alive {age:.0f} s ago): wait, use another --out-dir, or delete run.lock if it died")
            aside = f"{self.path}.stale.{self.me['token']}"
            with suppress(FileNotFoundError):  # of runs racing to move it aside, one does
                os.rename(self.path, aside)
                if holder and self._read(aside)[0] not in (None, holder):
                    with suppress(FileExistsError):  # a fresh lock another run just took: give it back
                        os.link(aside, self.path)
                os.unlink(aside)
            self.note = f"took over {self.path} from {describe_owner(holder)}: {why}"
        else:
            raise UserError(f"could not take {self.path}: other runs keep taking it; use another --out-dir")
        threading.Thread(target=self._beat, name="out-dir heartbeat", daemon=True).start()
        return self

    def check(self) -> None:
        holder = self._read()[0]
        if holder is None:
            raise UserError(f"this run's lock {self.path} is gone (deleted, or --out-dir removed): rerun to resume")
        if holder != self.me:
            raise UserError(f"another run took over --out-dir {self.out_dir} ({describe_owner(holder)}), so "
                            f"this one stops without writing there; run one job per out-dir")

    def release(self) -> None:
        self._done.set()
        with suppress(OSError):  # a read-only filesystem: the next run takes it over (its owner is gone)
            if self._read()[0] == self.me:
                os.unlink(self.path)

    def _beat(self) -> None:
        while not self._done.wait(self.HEARTBEAT_S):
            with suppress(OSError):  # a filesystem hiccup: the next beat tries again
                if self._read()[0] == self.me:
                    os.utime(self.path)

    def _read(self, path: str | None = None):  # the lock's record (None if unreadable) and its mtime
        try:
            with open(path or self.path) as f:
                return json.load(f), os.fstat(f.fileno()).st_mtime
        except (OSError, ValueError):
            return None, 0.0


def process_start(pid: int):
    """Its start time (tells a reused pid apart); None if gone or a zombie (as ranks after a kill -9); 0 if alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        try:
            os.kill(pid, 0)
        except OSError as e:  # a PermissionError: alive, another user's
            return 0 if isinstance(e, PermissionError) else None
        return 0


def describe_owner(holder) -> str:
    if not holder:
        return "unknown"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"host {holder['host']}, pid {holder['pid']}{job}, since {holder.get('since', '?')}"


def lock_out_dir(out_dir: str, env: DistEnv):
    """Rank 0 checks --out-dir is writable and locks it, or every rank raises why not; rank 0's lock, or None."""
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
