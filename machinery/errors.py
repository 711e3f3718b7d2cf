"""The error protocol: a problem the user can fix is a UserError, raised on every rank at once.

A check raises UserError; call_and_agree (or files.write_on_main, for rank 0's writes) raises it on
every rank, so that all leave together; the entry point says it once (leave_on_user_error), and the
exit status says which kind it was: 2 for bad input, 74 for a failed write, 75 for a requested stop."""
from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist

from machinery.output import is_main_process, log, report_to_launcher


class UserError(Exception):
    """A problem the user can fix: printed as one line, without a traceback, and the run exits 2."""
    exit_status = 2


class WriteError(UserError):
    """A write of the run's files failed (no space, quota, read-only, permission, I/O error): one line
    that says what failed, why, what is intact and the way out; the run exits 74 (EX_IOERR)."""
    exit_status = 74


class RendezvousError(UserError):
    """init_process_group failed. Every rank that meets it says why: there is no process group to wait
    on, and rank 0 may be the one left waiting (gloo's accepting side waits far longer than --timeout)."""


EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run again (requeue) to resume


def call_and_agree(fn, *args, here: bool = True, **kwargs):
    """fn(*args, **kwargs) on this rank (if `here`), then agree_on_error: a UserError on any rank is
    raised on every rank, and so is an OSError (a missing or unreadable file), named after fn. Returns
    fn's result (None where it did not run)."""
    result, error = None, None
    if here:
        try:
            result = fn(*args, **kwargs)
        except UserError as e:
            error = e
        except OSError as e:
            error = UserError(f"{getattr(fn, '__name__', 'a call')} failed: {e}")
    agree_on_error(error)
    return result


def leave_on_user_error(e: UserError) -> int:
    """Rank 0 prints the one line; then the ranks leave together, as torchrun kills the other ranks as
    soon as one exits and rank 0 must have said why first. Returns the exit status: 2, or 74 for a
    failed write."""
    report_to_launcher(f"error: {e}")  # torchrun's failure report names it too
    # no process group: every rank says why, as rank 0 may still be waiting
    if isinstance(e, RendezvousError):
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    log(f"error: {e}", file=sys.stderr)
    if dist.is_initialized():
        dist.barrier()
        # Every rank is leaving with this status now. The first one out makes the launcher (srun
        # --kill-on-bad-exit, torchrun) SIGTERM the others, which would turn their agreed status into
        # "Terminated" (143, and the job's status with it): they finish leaving instead.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif not is_main_process():
        time.sleep(5)
    return e.exit_status


# ---------------------------------------------------- collectives, and a peer that hung or died

def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_gather(obj):
    """Every rank's `obj`, as a list indexed by rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree_on_error(error: UserError | None) -> None:
    """One collective: if any rank hit a UserError, the first one is raised on every rank (with its
    class, so its exit status), and no rank is left waiting for another in a later collective."""
    errors = [(r, e) for r, e in enumerate(all_gather(error)) if e is not None]
    if errors:
        rank, e = errors[0]
        raise type(e)(f"{e} (on rank {rank})" if dist.is_initialized() and rank != 0 else str(e))


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind `e`: itself, or one in its chain (torch.save reports a failed write of its zip
    as RuntimeError "unexpected pos ..." raised while handling the OSError)."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


joined = {}  # the process group's store, kept past destroy_process_group (the entry point's teardown)


def note_host_in_store(rank: int, host: str) -> None:
    """Each rank's host in the process group's store, for ranks_that_did_not_arrive's line; and the store kept
    for it, as the teardown destroys the process group before the entry point explains a timeout."""
    try:
        joined["store"] = dist.distributed_c10d._get_default_store()
        joined["store"].set(f"host/{rank}", host)
    except Exception:  # noqa: BLE001
        pass
