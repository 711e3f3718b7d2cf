"""A problem the user can fix is a UserError, raised on every rank at once (call_and_agree), so all leave together;
leave_on_user_error says it once, and the exit status says which kind: 2 bad input, 74 a failed write, 75 a stop."""

import signal
import sys
import time
from contextlib import suppress

import torch
import torch.distributed as dist

from machinery.output import is_main_process, log, report_to_launcher


class UserError(Exception):
    exit_status = 2  # a problem the user can fix: said in one line, without a traceback


class WriteError(UserError):
    exit_status = 74  # EX_IOERR: a write of the run's files failed (why, what is intact, the way out)


class RendezvousError(UserError):
    """init_process_group failed: every rank says why (gloo's accept may keep rank 0 past --timeout)."""


EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; run again (requeue) to resume


def call_and_agree(fn, *args, here: bool = True, **kwargs):
    """fn(...) where `here`; a UserError (or OSError, named after fn) on any rank raised on all; fn's result or None."""
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
    """Rank 0 says it; the ranks leave together (torchrun kills all once one exits). Returns e.exit_status."""
    report_to_launcher(f"error: {e}")  # torchrun's failure report names it too
    if isinstance(e, RendezvousError):  # no process group: every rank says why
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    log(f"error: {e}", file=sys.stderr)
    if dist.is_initialized():
        dist.barrier()
        # srun and torchrun SIGTERM the rest once one rank is out: ignored, or their status would be 143 (Terminated)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif not is_main_process():
        time.sleep(5)
    return e.exit_status


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_gather(obj):  # every rank's `obj`, indexed by rank
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree_on_error(error: UserError | None) -> None:
    """One collective: the first rank's UserError, if any, raised on every rank with its class (so its status)."""
    for rank, e in enumerate(all_gather(error)):
        if e is not None:
            raise type(e)(f"{e} (on rank {rank})" if rank else str(e))


joined = {}  # the process group's store, kept past destroy_process_group (the entry point's teardown)


def note_host_in_store(rank: int, host: str) -> None:  # for diagnose.ranks_that_did_not_arrive
    with suppress(Exception):
        joined["store"] = dist.distributed_c10d._get_default_store()
        joined["store"].set(f"host/{rank}", host)
