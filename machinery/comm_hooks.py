"""DDP's communication hooks for --comm-hook, torch's own (torch.distributed.algorithms.ddp_comm_hooks), and what
each changes, said at the start. Loaded only when a run asks for a hook (train_utils.comm_hook, log_start)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from machinery.errors import UserError
from machinery.launch import DistEnv

HALVES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def torch_comm_hook(cfg, env: DistEnv) -> tuple:
    """(state, hook) for DDP.register_comm_hook. fp16 and bf16 cast each bucket to 16 bits, divide it by the world
    size, all-reduce it and cast it back (half the bytes); one the backend cannot all-reduce here is refused in one
    line naming those it can. PowerSGD sends rank --powersgd-rank factors of each large gradient after
    --powersgd-start plain steps, its error fed back into the next step. Its state is not checkpointed: it is laid
    out by DDP's buckets, which a new process regroups after its first step, so a resumed run starts PowerSGD
    afresh, plain steps first (comm_hook_notes says so)."""
    if cfg.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                            start_powerSGD_iter=cfg.powersgd_start, random_seed=cfg.seed)
        return state, powerSGD_hook.powerSGD_hook
    if not all_reduces(HALVES[cfg.comm_hook], env.device):
        works = [name for name, dtype in HALVES.items() if name != cfg.comm_hook and all_reduces(dtype, env.device)]
        raise UserError(f"--comm-hook {cfg.comm_hook}: the {dist.get_backend()} backend here cannot all-reduce "
                        f"{HALVES[cfg.comm_hook]} tensors; use --comm-hook {' or '.join([*works, 'none'])}")
    return None, {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[cfg.comm_hook]


def all_reduces(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the process group all-reduces a `dtype` tensor on `device` (a collective: every rank asks alike)."""
    try:
        dist.all_reduce(torch.ones(1, dtype=dtype, device=device))
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def comm_hook_notes(cfg, ckpt: dict | None, *, steps: int) -> list:
    """What --comm-hook changes that a user may not expect, each in a line: nothing in one process; in several, the
    exactness that compression gives up; PowerSGD never compressing in a short run, and starting afresh on a resume
    (`ckpt`: the checkpoint resumed, if any; `steps`: the run's optimizer steps)."""
    hook = cfg.comm_hook
    if hook == "none":
        return []
    if cfg.world_size == 1:
        return [f"--comm-hook {hook} does nothing in a run of one process: there is no all-reduce to compress"]
    what = ("rounds the all-reduced gradients to 16 bits" if hook in ("fp16", "bf16") else
            f"approximates the all-reduced gradients (rank {cfg.powersgd_rank}, after {cfg.powersgd_start} plain "
            f"steps)")
    notes = [f"--comm-hook {hook} {what}: the run no longer trains bit for bit as one with another split of the "
             f"same global batch (ranks x micro-steps), nor does a resume onto another world size"]
    if hook == "powersgd" and cfg.powersgd_start >= steps:
        notes.append(f"--powersgd-start {cfg.powersgd_start} is at least the run's {steps} optimizer steps: "
                     f"PowerSGD never compresses; lower --powersgd-start")
    elif hook == "powersgd" and ckpt is not None:
        notes.append(f"PowerSGD starts afresh on this resume: {cfg.powersgd_start} steps of plain all-reduce, "
                     f"then compression with no error carried over (its state follows DDP's buckets, which a new "
                     f"process regroups after its first step)")
    return notes
