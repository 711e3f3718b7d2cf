"""The run's files: atomic writes, rank 0's agreed on by every rank, a failed write in one line."""

import datetime
import errno
import json
import os
import tempfile
from contextlib import suppress

import torch

from machinery.errors import UserError, WriteError, agree_on_error


def write_json(path: str, obj) -> None:
    write_text(path, json.dumps(obj, indent=2))


def write_text(path: str, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write(path: str, write, before_replace=lambda: None) -> None:
    """write(f) into a synced temporary file, renamed over `path` after before_replace(): never half a file."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        before_replace()
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with suppress(OSError):  # the rename made durable; some network filesystems refuse fsync on a directory
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_writable(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-").close()
    except OSError as e:
        raise UserError(f"--out-dir {out_dir} is not writable ({e.strerror}); choose another directory") from None


WAY_OUT = {
    errno.ENOSPC: "free space in {d} (or use another --out-dir)",
    errno.EDQUOT: "free space under your quota (or use another --out-dir)",
    errno.EROFS: "{d} is on a read-only filesystem: use another --out-dir",
    **dict.fromkeys((errno.EACCES, errno.EPERM), "make {d} writable for you, or use another --out-dir"),
    errno.ENOENT: "{d}, or a file in it, was removed while the run wrote there: put it back",
    errno.EIO: "the filesystem failed: check it, or use another --out-dir",
}


def describe_write_failure(e: OSError, what: str, out_dir: str, then: str = "run the same command to resume") -> str:
    intact = "no checkpoint was written yet"
    for path in checkpoint_paths(out_dir, 10):
        try:  # mmap: only the small progress record is read, whatever the model's size
            p = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["progress"]
        except Exception:  # missing, or the one a crash cut short: the next one back
            continue
        intact = f"the last good checkpoint, {path} ({describe_position(**p)}), is intact"
        break
    named = e.filename and not os.path.basename(str(e.filename)).startswith(".")  # not one of our temporary files
    return (f"{(e.strerror or str(e)).lower()} writing {what} in {e.filename if named else out_dir}; {intact}: "
            f"{WAY_OUT.get(e.errno, 'fix that').format(d=out_dir)}, then {then}")


def checkpoint_paths(out_dir: str, keep: int) -> list:  # the newest first: checkpoint.pt, checkpoint.1.pt, ...
    return [os.path.join(out_dir, f"checkpoint.{i}.pt" if i else "checkpoint.pt") for i in range(keep)]


def describe_position(epoch: int, position: int, step: int, **_) -> str:  # where a checkpoint's progress stands
    return f"at step {step} of epoch {epoch + 1}" if position else f"after epoch {epoch}"


def write_on_main(env, write, *, what: str, out_dir: str, lock=None, then: str = "run the same command to resume"):
    """write() on rank 0 if this run still owns out_dir (`lock`), as a collective: every rank raises its UserError
    (a failed write: a WriteError), none waits for a rank 0 gone; a bug's error is raised where it happened."""
    error = None
    try:
        if env.is_main:
            if lock is not None:
                lock.check()
            write()
    except UserError as e:
        error = e
    except (OSError, RuntimeError) as e:
        cause = e  # torch.save wraps an OSError in a RuntimeError "unexpected pos ..."
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:  # not a failed write: a bug
            raise
        error = WriteError(describe_write_failure(cause, what, out_dir, then))
    agree_on_error(error)


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
