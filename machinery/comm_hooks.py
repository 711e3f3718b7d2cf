"""--comm-hook: torch's DDP communication hooks, and what each changes."""
import contextlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from machinery.errors import UserError
from machinery.launch import DistEnv

HALVES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def torch_comm_hook(cfg, env: DistEnv) -> tuple:
    """(state, hook) for DDP.register_comm_hook, (None, None) for DDP's own all-reduce; a half precision the backend
    cannot all-reduce here is refused."""
    if cfg.comm_hook == "none":
        return None, None
    if cfg.comm_hook == "powersgd":  # its state is not checkpointed: comm_hook_notes says why
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                                            start_powerSGD_iter=cfg.powersgd_start, random_seed=cfg.seed)
        return state, powerSGD_hook.powerSGD_hook
    works = []  # a collective: every rank tries alike, the other half only to name it in a refusal
    for name in sorted(HALVES, key=lambda name: name != cfg.comm_hook):
        with contextlib.suppress(RuntimeError, TypeError, ValueError):
            dist.all_reduce(torch.ones(1, dtype=HALVES[name], device=env.device))
            works.append(name)
        if works == [cfg.comm_hook]:
            break
    if cfg.comm_hook not in works:
        raise UserError(f"--comm-hook {cfg.comm_hook}: the {dist.get_backend()} backend here cannot all-reduce "
                        f"{HALVES[cfg.comm_hook]} tensors; use --comm-hook {' or '.join([*works, 'none'])}")
    return None, getattr(default_hooks, f"{cfg.comm_hook}_compress_hook")


def comm_hook_notes(cfg, ckpt: dict | None, *, steps: int) -> list:
    """What --comm-hook changes that a user may not expect, a line each (`steps`: the run's optimizer steps)."""
    hook = cfg.comm_hook
    if hook == "none":
        return []
    if cfg.world_size == 1:
        return [f"--comm-hook {hook} does nothing in a run of one process: there is no all-reduce to compress"]
    what = ("rounds the all-reduced gradients to 16 bits" if hook in ("fp16", "bf16") else f"approximates the "
            f"all-reduced gradients (rank {cfg.powersgd_rank}, after {cfg.powersgd_start} plain steps)")
    notes = [f"--comm-hook {hook} {what}: the run no longer trains bit for bit as one with another split of the "
             f"same global batch (ranks x micro-steps), nor does a resume onto another world size"]
    if hook == "powersgd" and cfg.powersgd_start >= steps:
        notes.append(f"--powersgd-start {cfg.powersgd_start} is at least the run's {steps} optimizer steps: "
                     f"PowerSGD never compresses; lower --powersgd-start")
    elif hook == "powersgd" and ckpt is not None:
        notes.append(f"PowerSGD starts afresh on this resume: {cfg.powersgd_start} steps of plain all-reduce, "
                     "then compression with no error carried over (docs/comm-hooks.md: why)")
    return notes
