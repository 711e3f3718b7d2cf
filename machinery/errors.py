"""The error protocol: a problem the user can fix is a UserError, raised on every rank at once.

call_and_agree (or files.write_on_main) raises it on every rank, so all leave together; leave_on_user_error says it
once, and the exit status says which kind: 2 for bad input, 74 for a failed write, 75 for a requested stop."""
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
    """A write of the run's files failed: one line with why, what is intact and the way out; exits 74 (EX_IOERR)."""
    exit_status = 74


class RendezvousError(UserError):
    """init_process_group failed: every rank says why (rank 0 may be left waiting: gloo's accept outlasts --timeout)."""


EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run again (requeue) to resume


def call_and_agree(fn, *args, here: bool = True, **kwargs):
    """fn(*args, **kwargs) on this rank (if `here`), then agree_on_error: a UserError, or an OSError named after fn,
    on any rank is raised on every rank. Returns fn's result (None where it did not run)."""
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
    """Rank 0 says it; the ranks leave together (torchrun kills all once one exits). Returns e.exit_status (2 or 74)."""
    report_to_launcher(f"error: {e}")  # torchrun's failure report names it too
    if isinstance(e, RendezvousError):  # no process group: every rank says why, as rank 0 may still be waiting
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    log(f"error: {e}", file=sys.stderr)
    if dist.is_initialized():
        dist.barrier()
        # The first rank out makes the launcher (srun --kill-on-bad-exit, torchrun) SIGTERM the others, turning their
        # agreed status into "Terminated" (143, and the job's status with it): they finish leaving instead.
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
    """One collective: the first rank's UserError, if any, is raised on every rank with its class (so its status)."""
    errors = [(r, e) for r, e in enumerate(all_gather(error)) if e is not None]
    if errors:
        rank, e = errors[0]
        raise type(e)(f"{e} (on rank {rank})" if dist.is_initialized() and rank != 0 else str(e))


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind `e`, itself or in its chain (torch.save raises RuntimeError "unexpected pos ..." over it)."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


joined = {}  # the process group's store, kept past destroy_process_group (the entry point's teardown)


def note_host_in_store(rank: int, host: str) -> None:
    """Each rank's host in the process group's store, for ranks_that_did_not_arrive; the store is kept in `joined`, as
    the teardown destroys the process group before the entry point explains a timeout."""
    try:
        joined["store"] = dist.distributed_c10d._get_default_store()
        joined["store"].set(f"host/{rank}", host)
    except Exception:  # noqa: BLE001
        pass
