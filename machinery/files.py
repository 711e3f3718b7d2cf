"""The run's files: atomic writes, rank 0's writes agreed on by every rank, a failed write said in one line."""
from __future__ import annotations

import datetime
import errno
import json
import os
import tempfile

import torch

from machinery.errors import UserError, WriteError, agree_on_error, os_error_of


def write_json(path: str, obj) -> None:
    """Write JSON atomically: a temporary file in the same directory, then a rename."""
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))


def write_text(path: str, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write(path: str, write, before_replace=None) -> None:
    """write(f) into a synced temporary file, renamed over `path` after before_replace(): never half a file."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace:
            before_replace()
        os.replace(tmp, path)  # atomic on POSIX
        fsync_dir(d)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def fsync_dir(d: str) -> None:
    """Make the renames in `d` durable, so a node crash right after a save keeps the new file."""
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some network filesystems refuse fsync on a directory; the rename still stands
        pass


def check_writable(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UserError(f"--out-dir {out_dir} is not writable ({e.strerror}); choose another "
                        f"directory") from None


WAY_OUT = {
    errno.ENOSPC: "free space in {d} (or use another --out-dir)",
    errno.EDQUOT: "free space under your quota (or use another --out-dir)",
    errno.EROFS: "{d} is on a read-only filesystem: use another --out-dir",
    errno.EACCES: "make {d} writable for you, or use another --out-dir",
    errno.EPERM: "make {d} writable for you, or use another --out-dir",
    errno.ENOENT: "{d}, or a file in it, was removed while the run wrote there: put it back",
    errno.EIO: "the filesystem failed: check it, or use another --out-dir",
}


def describe_write_failure(e: OSError, what: str, out_dir: str,
                           then: str = "run the same command to resume") -> str:
    """One line for a failed write: what failed, where, the OS's reason, what is intact, the way out."""
    reason = (e.strerror or str(e)).lower()
    named = e.filename and not os.path.basename(str(e.filename)).startswith(".")  # not one of our temporary files
    way_out = WAY_OUT.get(e.errno, "fix that").format(d=out_dir)
    return (f"{reason} writing {what} in {e.filename if named else out_dir}; {describe_intact(out_dir)}: "
            f"{way_out}, then {then}")


def checkpoint_paths(out_dir: str, keep: int) -> list:
    """checkpoint.pt is the newest; checkpoint.1.pt the one before, and so on."""
    return [os.path.join(out_dir, "checkpoint.pt")] + [
        os.path.join(out_dir, f"checkpoint.{i}.pt") for i in range(1, keep)]


def describe_position(epoch: int, position: int, step: int, **_) -> str:
    """Where a checkpoint stands (its progress record): "after epoch 2", or "at step 10 of epoch 3"."""
    return f"at step {step} of epoch {epoch + 1}" if position else f"after epoch {epoch}"


def describe_intact(out_dir: str) -> str:
    """What a failed write leaves safe: the newest checkpoint that loads, read back from the disk."""
    for path in checkpoint_paths(out_dir, 10):
        try:  # mmap: only the small progress record is read, whatever the model's size
            p = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["progress"]
        except Exception:  # missing, or the one a crash cut short: the next one back
            continue
        return f"the last good checkpoint, {path} ({describe_position(**p)}), is intact"
    return "no checkpoint was written yet"


def write_on_main(env, write, *, what: str, out_dir: str, lock=None,
                  then: str = "run the same command to resume") -> None:
    """Rank 0 runs write(), writing `what` in out_dir (with `lock`, only while this run owns it). A collective: every
    rank raises the same error and all leave together, none waiting in a later collective for a rank 0 that is gone."""
    error = try_write(write, what=what, out_dir=out_dir, lock=lock, then=then) if env.is_main else None
    agree_on_error(error)


def try_write(write, *, what: str, out_dir: str, lock=None, then: str = "run the same command to resume"):
    """write() unless `lock` says another run took out_dir: None, or the UserError why not (a WriteError naming what
    is intact and the way out). A failure that is not a write's is a bug: raised, with its traceback."""
    try:
        if lock is not None:
            lock.check()
        write()
    except UserError as e:
        return e
    except (OSError, RuntimeError) as e:
        cause = os_error_of(e)
        if cause is None:  # not a failed write (torch.save turns one into a RuntimeError): a bug
            raise
        return WriteError(describe_write_failure(cause, what, out_dir, then))
    return None


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
