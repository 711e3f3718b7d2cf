"""Checkpoint files: written whole, newest first; the format; the newest that loads; room for the next."""

import errno
import os
import shutil
import sys

import torch
from torch.utils._pytree import tree_leaves

from machinery.errors import UserError, WriteError
from machinery.files import atomic_write, checkpoint_paths, describe_write_failure
from machinery.output import log

# Each flag's rule in RESUME_RULES: one of these, or (one of these, what a checkpoint from before the flag meant).
DATA, MODEL, RECIPE, NOTED, QUIET = "data", "model", "recipe", "noted", "quiet"
ANY = object()  # as `before`: any value continues a checkpoint written before the flag


def load_latest_checkpoint(out_dir: str, load, keep: int):
    """The newest checkpoint that load(path) reads and its path, or (None, None); if none reads, a UserError."""
    problems = []
    for path in filter(os.path.exists, checkpoint_paths(out_dir, max(keep, 10))):
        try:
            ckpt = load(path)
            if not isinstance(ckpt, dict) or "model" not in ckpt or "progress" not in ckpt:
                raise TypeError("not a checkpoint of this script")
        except Exception as e:
            problems.append(f"{path} cannot be loaded ({type(e).__name__}: {str(e).partition(chr(10))[0]})")
            continue
        for p in problems:
            log(f"warning: {p}; using the older {path}", file=sys.stderr)
        return ckpt, path
    if problems:
        raise UserError(f"no usable checkpoint in {out_dir}: {problems[0]}; move them away to start afresh")
    return None, None


def check_room(out_dir: str, objects: dict, copies: int = 1) -> None:
    need = copies * sum(state_bytes(obj) for obj in objects.values())
    free = shutil.disk_usage(out_dir).free
    if free < need:
        what = f"{'a checkpoint' if copies == 1 else f'{copies} checkpoints'} of about {need / 2**20:.1f} MiB"
        enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), out_dir)
        raise WriteError(describe_write_failure(enospc, f"{what} ({free / 2**20:.1f} MiB free)", out_dir))


def state_bytes(obj) -> int:
    """obj.state_dict()'s tensor bytes; an optimizer without state yet: a copy's, stepped once on CPU stand-ins."""
    params = [p for g in getattr(obj, "param_groups", ()) for p in g["params"]]
    if isinstance(obj, torch.optim.Optimizer) and len(obj.state) < len(params):
        try:
            groups = [{**{k: v for k, v in g.items() if k not in ("params", "fused", "foreach", "capturable")},
                       "params": [torch.zeros(p.shape, dtype=p.dtype, requires_grad=True) for p in g["params"]]}
                      for g in obj.param_groups]
            for p in (p for g in groups for p in g["params"]):
                p.grad = torch.zeros_like(p)
            obj = type(obj)(groups)
            obj.step()
        except Exception:  # not steppable so (a closure, sparse gradients, a wrapper): as Adam's two moments
            return 2 * sum(p.numel() * p.element_size() for p in params)
    return sum(t.numel() * t.element_size() for t in tree_leaves(obj.state_dict()) if isinstance(t, torch.Tensor))


def save_checkpoint(out_dir: str, write, keep: int, best: bool = False) -> None:
    """write(f) as checkpoint.pt (older ones shifted down), and best.pt if `best`: a crash leaves the last loadable."""
    paths = checkpoint_paths(out_dir, keep)
    for name in os.listdir(out_dir):  # what a write killed halfway left behind (only rank 0 writes)
        if name.startswith((".checkpoint.", ".best.pt.")) and name.endswith(".tmp"):
            os.unlink(os.path.join(out_dir, name))
    if best:  # written first: a checkpoint.pt of this epoch never stands beside an older best.pt
        atomic_write(os.path.join(out_dir, "best.pt"), write)

    def shift_older():
        for older, newer in zip(reversed(paths[1:]), reversed(paths[:-1])):
            if os.path.exists(newer):
                os.replace(newer, older)
    atomic_write(paths[0], write, before_replace=shift_older)


def is_best_epoch(history: list) -> bool:  # the last epoch's validation accuracy beats every one before
    return bool(history) and all(history[-1]["val_acc"] > m["val_acc"] for m in history[:-1])
