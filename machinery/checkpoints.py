"""Checkpoint files: newest first, written whole; the format and its required parts; finding the one
to continue, what a resumed run may change, whether it is the same data and model; room for the next."""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys

import torch

from machinery.errors import UserError, WriteError
from machinery.files import atomic_write, checkpoint_paths, describe_write_failure
from machinery.output import log

# What a resume does with a flag: the rules of the recipe's table (config.py: RESUME_RULES), which says for
# each flag one of these, or (one of these, what a checkpoint written before the flag meant).
DATA, MODEL, RECIPE, NOTED, QUIET = "data", "model", "recipe", "noted", "quiet"
ANY = object()  # as `before`: any value continues a checkpoint written before the flag


def load_checkpoint(path: str, device: torch.device) -> dict:
    try:
        # weights_only: a checkpoint is data, never code; this refuses pickled objects.
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise UserError(f"{path} cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def load_latest_checkpoint(out_dir: str, device: torch.device, keep: int):
    """The newest checkpoint that loads, and its path; (None, None) if there is none. Unreadable
    ones (truncated, corrupt, or holding pickled code) are skipped with a warning, and if none can
    be read the run refuses to start rather than overwrite them."""
    problems = []
    for path in checkpoint_paths(out_dir, max(keep, 10)):
        if not os.path.exists(path):
            continue
        try:
            ckpt = load_checkpoint(path, device)
            if not isinstance(ckpt, dict) or "model" not in ckpt or "progress" not in ckpt:
                raise UserError(f"{path} is not a checkpoint of this script")
        except UserError as e:
            problems.append(str(e))
            continue
        for p in problems:
            log(f"warning: {p}; using the older {path}", file=sys.stderr)
        return ckpt, path
    if problems:
        raise UserError(f"no usable checkpoint in {out_dir}: {problems[0]}; move the checkpoint files "
                        f"away to start afresh")
    return None, None


# The format. What every checkpoint holds besides the state the recipe registers (train_utils.Checkpoint:
# the model, optimizer and scaler, required; what an option adds, optional): where training stands, the
# config and model it trained, its data's fingerprints, and every rank's RNG states.
REQUIRED_KEYS = ("progress", "config", "model_config", "data", "world_size", "rng_cpu", "rng_cuda")
REQUIRED_CONFIG_KEYS = ("data_spec", "epochs", "batch_size", "per_rank_batch", "accumulation_steps",
                        "micro_batch", "micro_batch_size", "lr", "device_type")
# Where training stands (train_utils.Progress's fields; a unit test holds the two together).
REQUIRED_PROGRESS_KEYS = ("epoch", "position", "step", "sums", "elapsed_s", "history", "total_time_s",
                          "total_images", "stopped_early")
# Added since, with the default that is exact for an older checkpoint: it skipped no unreadable samples.
OPTIONAL_PROGRESS_KEYS = ("skipped",)


def check_format(ckpt, path: str, required=()) -> None:
    """Raise UserError unless `ckpt` holds everything this version requires (the keys above, and the
    `required` state): an older train_ddp.py's checkpoint is refused in one line, never half-read with
    guessed defaults."""
    missing = [k for k in REQUIRED_KEYS + tuple(required) if k not in ckpt]
    missing += [f"config.{k}" for k in REQUIRED_CONFIG_KEYS if k not in ckpt.get("config", {})]
    missing += [f"progress.{k}" for k in REQUIRED_PROGRESS_KEYS if k not in ckpt.get("progress", {})]
    if missing:
        raise UserError(f"{path} was written by an older train_ddp.py (it lacks {', '.join(missing[:3])}); "
                        f"evaluate or resume it with that version, or train afresh in another --out-dir")


def checkpoint_flags(args, explicit: set, ckpt, rules: dict) -> tuple:
    """The flags this run continues `ckpt` with, and notes on what it changes: `args`, but for those the
    checkpoint rules, as each flag's resume rule in `rules` (config.py's RESUME_RULES) says. `args` itself is
    left as parsed.

    Raises UserError if the data, the model or the recipe differ: resuming would mix two runs. --evaluate
    takes every flag it was not given from the checkpoint, so `--evaluate --out-dir D` is enough. A
    training run keeps the checkpoint's --micro-batch unless given one, so a resume on fewer GPUs
    keeps the per-GPU memory (and more accumulation steps keep the global batch)."""
    flags = dict(vars(args))
    if ckpt is None:
        return flags, []
    saved = ckpt["config"]
    rules = {k: rule if isinstance(rule, tuple) else (rule, None) for k, rule in rules.items()}
    evaluate = flags["evaluate"]
    if evaluate:
        flags.update({k: v for k, v in saved.items()
                      if k in flags and k not in explicit | {"evaluate", "out_dir"}})
    elif "micro_batch" not in explicit:
        # The checkpoint's per-rank memory: its micro-batch, or its whole per-rank batch if it had none.
        flags["micro_batch"] = saved["micro_batch"] or saved["micro_batch_size"]
    model_flags = {k for k in ckpt["model_config"] if k in flags}  # the flags build_model's shapes follow
    for key, (rule, before) in rules.items():
        # --evaluate scores what was trained, on any share of the test set (--test-size)
        if key not in flags or (evaluate and (rule == RECIPE or key == "test_size")):
            continue
        old, flag = saved.get(key, before), "--" + key.replace("_", "-")
        if (rule == DATA or key in model_flags) and old not in (None, ANY) and flags[key] != old:
            if key not in saved:  # a checkpoint from before the flag, which then meant `before`
                raise UserError(f"{flag} {flags[key]} would change the data that the checkpoint in "
                                f"{flags['out_dir']} trained on (it was written before {flag}, which means "
                                f"{flag} {old}): leave {flag} out to continue it, or use another --out-dir "
                                f"for a new run")
            what = "on other data" if rule == DATA else "another model"
            raise UserError(f"{flag} {flags[key]} differs from the {old} of the checkpoint in "
                            f"{flags['out_dir']}, which trained {what}: use another --out-dir for a new run, "
                            f"or {flag} {old} to continue it")
        elif rule == RECIPE and old is not ANY and flags[key] != old and (key in saved or flags[key]):
            # From before the option, with before None: it was off; a value that turns it on changes the run.
            keep = f"leave {flag} out" if old in (None, False) else f"give {flag} {old}"
            raise UserError(f"{flag} {flags[key]} differs from the {old} the checkpoint in "
                            f"{flags['out_dir']} trained with: changed mid-run it would make the run another "
                            f"recipe; {keep} to continue it, or use another --out-dir for a new run")
    if evaluate:
        return flags, []
    changed = [f"--{k.replace('_', '-')} {saved[k]} -> {v}" for k, v in flags.items()
               if k in saved and rules.get(k, (NOTED,))[0] == NOTED and k not in model_flags and saved[k] != v
               and (k != "micro_batch" or k in explicit)]  # a kept per-rank memory cap is no change
    return flags, ["resumed with changes: " + ", ".join(changed)] if changed else []


def check_same_device(ckpt, path: str, device: torch.device, evaluate_only: bool) -> None:
    """Raise UserError if this run would continue `ckpt` on another device type."""
    trained_on = ckpt["config"]["device_type"] if ckpt is not None else device.type
    if trained_on != device.type and not evaluate_only:  # optimizer state and RNGs belong to the device type
        raise UserError(f"{path} was trained on {trained_on}, and this run is on {device.type}: resume with "
                        f"--device {trained_on}, or train afresh in another --out-dir")


def describe_shape(shape: dict) -> str:
    classes = f" of {shape['num_classes']} classes" if "num_classes" in shape else ""
    return f"{shape['channels']} x {shape['height']} x {shape['width']} images{classes}"


def read_summary(out_dir: str) -> dict:
    """The out-dir's summary.json, or {} if there is none (or it does not load)."""
    try:
        with open(os.path.join(out_dir, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def check_finished(ckpt, path: str, flags: dict, notes: list) -> str | None:
    """None if the run in `ckpt` has epochs left to train under `flags` (or finished without writing its
    summary: the run then writes it). If not: rerun with the same command (a requeue, a restart), the line
    that says there is nothing to train; with changed flags, or --epochs at or below the epochs it has
    done, a UserError naming the two ways on. Never a silent run that trains nothing."""
    progress, saved = ckpt["progress"], ckpt["config"]
    done, epochs = progress["epoch"], flags["epochs"]
    if not progress["stopped_early"] and done < epochs:
        return None
    history = progress["history"]
    result = (f"; final validation accuracy {history[-1]['val_acc']:.4f}, best "
              f"{max(m['val_acc'] for m in history):.4f}" if history else "")
    holds = (f"{path} holds a run that stopped early at epoch {done} (target accuracy reached{result})"
             if progress["stopped_early"] else f"{path} holds a run trained for {done} epochs{result}")
    ways = ("another --out-dir starts afresh" if progress["stopped_early"] else
            f"--epochs N (more than {done}) trains it on, or another --out-dir starts afresh")
    if not notes and epochs == saved["epochs"]:
        summary = read_summary(flags["out_dir"])
        if not (summary.get("finished") and summary.get("epochs_completed") == done):
            return None  # it ended before its records were whole: this run trains nothing and writes them
        return f"{holds}: nothing to train; {ways}."
    if epochs != saved["epochs"] and epochs <= done:
        raise UserError(f"--epochs {epochs} leaves nothing to train: {holds}; {ways}")
    raise UserError(f"{holds}, and this command changes it ({'; '.join(notes)}) but trains nothing: {ways}")


def check_same_data(found, shape: dict, fingerprints: dict) -> None:
    """Raise UserError unless the data just loaded are those the checkpoint trained on: first their shape
    (channels, height, width, and the classes when known), then the samples themselves (same flags,
    other files)."""
    if found is None or found.ckpt is None:
        return
    out_dir, data_dir = found.flags.get("out_dir", "the out-dir"), found.flags.get("data_dir", "?")
    saved_shape = {k: found.ckpt["config"]["data_spec"][k] for k in shape}
    if saved_shape != shape:
        raise UserError(f"load_data gives {describe_shape(shape)}, but the checkpoint in {out_dir} was "
                        f"trained on {describe_shape(saved_shape)}: use another --out-dir for a new run, or "
                        f"load the data it trained on")
    saved = found.ckpt["data"]
    for split, fp in fingerprints.items():
        if split == "test" and found.flags.get("test_size") != found.ckpt["config"]["test_size"]:
            continue  # --evaluate --test-size N scores another share of the test set, on purpose
        if saved[split] != fp:
            raise UserError(f"the {split} data in --data-dir {data_dir} differ from those the checkpoint in "
                            f"{out_dir} was trained on (fingerprint {fp}, checkpoint {saved[split]}): point "
                            f"--data-dir at the same data, or use another --out-dir for a new run")


def check_same_model(found, model_config: dict) -> None:
    """Raise UserError unless this run builds the model the checkpoint holds (its model_config)."""
    if found.ckpt is not None and found.ckpt["model_config"] != model_config:
        raise UserError(f"{found.path} holds {found.describe_model()}, but this run builds "
                        f"{describe_model(model_config)} (model_config in train_ddp.py): build the same "
                        f"model, or use another --out-dir")


def describe_model(cfg: dict) -> str:
    """A model_config in words: its "name" (else its keys and values), and its classes."""
    name = cfg.get("name") or ", ".join(f"{k} {v}" for k, v in cfg.items() if k != "num_classes")
    return f"{name} with {cfg['num_classes']} classes" if "num_classes" in cfg else name


def check_room(out_dir: str, objects: dict, copies: int = 1) -> None:
    """Refuse to start when out_dir has no room for `copies` more checkpoints of `objects` (name -> an
    object with state_dict(): what a checkpoint holds; 2 where an epoch's end may also write best.pt): a
    run that cannot save would train until its first checkpoint for nothing, and a restart after a full
    disk would do so again and again."""
    need = copies * sum(state_bytes(obj) for obj in objects.values())
    free = shutil.disk_usage(out_dir).free
    if free < need:
        what = "a checkpoint" if copies == 1 else f"{copies} checkpoints"
        raise WriteError(describe_write_failure(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), out_dir),
                                                f"{what} of about {need / 2**20:.1f} MiB "
                                                f"({free / 2**20:.1f} MiB free)",
                                                out_dir))


def state_bytes(obj) -> int:
    """The bytes of obj.state_dict()'s tensors. An optimizer makes its state at its first step, so before
    it the state is measured on a copy of the optimizer stepped once over stand-in parameters of the
    same shapes on the CPU (Adam's two moments, SGD's momentum, none for plain SGD)."""
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


def save_checkpoint(out_dir: str, state: dict, keep: int, best: bool = False) -> None:
    """Write the new checkpoint in full to a temporary file, then shift the older ones down and
    rename it into place; if `best`, also as best.pt. A crash at any point leaves the previous
    checkpoints loadable."""
    paths = checkpoint_paths(out_dir, keep)
    for name in os.listdir(out_dir):  # what a write killed halfway left behind (only rank 0 writes)
        if name.startswith((".checkpoint.", ".best.pt.")) and name.endswith(".tmp"):
            os.unlink(os.path.join(out_dir, name))
    if best:  # written first: a checkpoint.pt of this epoch never stands beside an older best.pt
        atomic_write(os.path.join(out_dir, BEST), lambda f: torch.save(state, f))

    def shift_older():
        for older, newer in zip(reversed(paths[1:]), reversed(paths[:-1])):
            if os.path.exists(newer):
                os.replace(newer, older)
    atomic_write(paths[0], lambda f: torch.save(state, f), before_replace=shift_older)


BEST = "best.pt"  # the checkpoint of the best validation accuracy so far (--val-size)


def is_best_epoch(history: list) -> bool:
    """Whether the last epoch of `history` has the best validation accuracy so far (the first of equals)."""
    return bool(history) and all(history[-1]["val_acc"] > m["val_acc"] for m in history[:-1])
