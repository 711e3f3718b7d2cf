"""Checkpoint files: written whole, newest first; the format; the newest that loads; room for the next."""
from __future__ import annotations

import errno
import os
import shutil
import sys

import torch

from machinery.errors import UserError, WriteError
from machinery.files import atomic_write, checkpoint_paths, describe_write_failure
from machinery.output import log

# What a resume does with a flag (machinery/resume.py): train_utils.py's RESUME_RULES gives each flag one of these, or
# (one of these, what a checkpoint written before the flag meant).
DATA, MODEL, RECIPE, NOTED, QUIET = "data", "model", "recipe", "noted", "quiet"
ANY = object()  # as `before`: any value continues a checkpoint written before the flag


def load_latest_checkpoint(out_dir: str, load, keep: int):
    """The newest checkpoint that load(path) reads (train_utils.find_checkpoint's torch.load), and its path; (None,
    None) if none. Unreadable ones (truncated, corrupt, pickled code) are skipped with a warning; if none reads,
    UserError rather than overwrite them."""
    problems = []
    for path in checkpoint_paths(out_dir, max(keep, 10)):
        if not os.path.exists(path):
            continue
        try:
            ckpt = load(path)
        except Exception as e:
            problems.append(f"{path} cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0]})")
            continue
        if not isinstance(ckpt, dict) or "model" not in ckpt or "progress" not in ckpt:
            problems.append(f"{path} is not a checkpoint of this script")
            continue
        for p in problems:
            log(f"warning: {p}; using the older {path}", file=sys.stderr)
        return ckpt, path
    if problems:
        raise UserError(f"no usable checkpoint in {out_dir}: {problems[0]}; move the checkpoint files "
                        f"away to start afresh")
    return None, None


# The format: besides the recipe's registered state (train_utils.Checkpoint), every checkpoint holds where training
# stands, the config and model it trained, its data's fingerprints, and every rank's RNG states.
REQUIRED_KEYS = ("progress", "config", "model_config", "data", "world_size", "rng_cpu", "rng_cuda")
REQUIRED_CONFIG_KEYS = ("data_spec", "epochs", "batch_size", "per_rank_batch", "accumulation_steps",
                        "micro_batch", "micro_batch_size", "lr", "device_type")
# Where training stands (train_utils.Progress's fields; a unit test holds the two together).
REQUIRED_PROGRESS_KEYS = ("epoch", "position", "step", "sums", "elapsed_s", "history", "total_time_s",
                          "total_images", "stopped_early")
# Added since, with the default that is exact for an older checkpoint: it skipped no unreadable samples.
OPTIONAL_PROGRESS_KEYS = ("skipped",)


def check_room(out_dir: str, objects: dict, copies: int = 1) -> None:
    """WriteError if out_dir lacks room for `copies` more checkpoints of `objects` (name -> object with state_dict();
    2 where best.pt may also be written): else the run trains to its first save for nothing, again at each restart."""
    need = copies * sum(state_bytes(obj) for obj in objects.values())
    free = shutil.disk_usage(out_dir).free
    if free < need:
        what = "a checkpoint" if copies == 1 else f"{copies} checkpoints"
        raise WriteError(describe_write_failure(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), out_dir),
                                                f"{what} of about {need / 2**20:.1f} MiB "
                                                f"({free / 2**20:.1f} MiB free)",
                                                out_dir))


def state_bytes(obj) -> int:
    """The bytes of obj.state_dict()'s tensors. An optimizer makes its state at its first step, so before that it is
    measured on a copy stepped once over CPU stand-ins of the same shapes (Adam's two moments, SGD's momentum)."""
    if (isinstance(obj, torch.optim.Optimizer)
            and len(obj.state) < sum(len(g["params"]) for g in obj.param_groups)):
        params = [p for g in obj.param_groups for p in g["params"]]
        try:
            groups = [{**{k: v for k, v in g.items()
                          if k not in ("params", "fused", "foreach", "capturable")},
                       "params": [torch.zeros(p.shape, dtype=p.dtype, requires_grad=True)
                                  for p in g["params"]]}
                      for g in obj.param_groups]
            for g in groups:
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            obj = type(obj)(groups)
            obj.step()
        except Exception:  # an optimizer that cannot be stepped so (a closure, sparse gradients, a wrapper):
            return 2 * tensor_bytes(params)  # two moments per parameter, as Adam keeps, at most as a rule
    return tensor_bytes(obj.state_dict())


def tensor_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def save_checkpoint(out_dir: str, write, keep: int, best: bool = False) -> None:
    """write(f) (train_utils.Checkpoint.save's torch.save) into a temporary file, shift the older checkpoints down,
    rename it in; if `best`, also as best.pt. A crash at any point leaves the previous checkpoints loadable."""
    paths = checkpoint_paths(out_dir, keep)
    for name in os.listdir(out_dir):  # what a write killed halfway left behind (only rank 0 writes)
        if name.startswith((".checkpoint.", ".best.pt.")) and name.endswith(".tmp"):
            os.unlink(os.path.join(out_dir, name))
    if best:  # written first: a checkpoint.pt of this epoch never stands beside an older best.pt
        atomic_write(os.path.join(out_dir, BEST), write)

    def shift_older():
        for older, newer in zip(reversed(paths[1:]), reversed(paths[:-1])):
            if os.path.exists(newer):
                os.replace(newer, older)
    atomic_write(paths[0], write, before_replace=shift_older)


BEST = "best.pt"  # the checkpoint of the best validation accuracy so far (--val-size)


def is_best_epoch(history: list) -> bool:
    """Whether the last epoch of `history` has the best validation accuracy so far (the first of equals)."""
    return bool(history) and all(history[-1]["val_acc"] > m["val_acc"] for m in history[:-1])
