"""What a resume checks (train_utils.find_checkpoint, Checkpoint.restore, dataset_utils.load_checked_data): its
format, the flags it continues with by the recipe's RESUME_RULES, the device type, a finished run, the same data (by
the fingerprint every checkpoint keeps, which load_checked_data takes from here in every run) and the same model."""
from __future__ import annotations

import hashlib
import json
import os

import torch

from machinery.checkpoints import (ANY, DATA, NOTED, RECIPE, REQUIRED_CONFIG_KEYS, REQUIRED_KEYS,
                                   REQUIRED_PROGRESS_KEYS)
from machinery.bad_samples import read_sample
from machinery.errors import UserError, all_gather
from machinery.output import log


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
    checkpoint rules, as each flag's resume rule in `rules` (train_utils.py's RESUME_RULES) says. `args` itself is
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
    """"3 x 32 x 32 images of 100 classes", or with the channels alone "3-channel images"."""
    classes = f" of {shape['num_classes']} classes" if "num_classes" in shape else ""
    if "height" not in shape:
        return f"{shape['channels']}-channel images{classes}"
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


def note_resume_changes(saved: dict, cfg, progress, draws: str) -> None:
    """The notes a resumed run's log opens with: what changed in the batch, the LR and the augmentation's draws."""
    before = saved.get("draws", "a hash of (seed, epoch, index), in the project's own ops (before torchvision's)")
    if before != draws and draws:
        log(f"note: the augmentation drew from {before} before, from {draws} now: the rest of the run trains on "
            f"other random crops than an uninterrupted run would (as good, not bit-identical)")
    if saved["lr"] != cfg.lr:
        log(f"note: the peak LR changed from {saved['lr']:.4g} to {cfg.lr:.4g} on resume")
    if saved["batch_size"] != cfg.batch_size:
        log(f"note: the global batch changed from {saved['batch_size']} to {cfg.batch_size} on resume: the "
            f"schedule keeps its place in samples (epoch {progress.epoch + 1} resumes at sample "
            f"{progress.position})")
    before = (saved["world_size"], saved["accumulation_steps"], saved["micro_batch_size"])
    if before != (cfg.world_size, cfg.accumulation_steps, cfg.micro_batch_size):
        same = "the same global batch" if saved["batch_size"] == cfg.batch_size else "another global batch"
        log(f"note: {before[0]} ranks x {before[1]} accumulation steps x {before[2]} before, "
            f"{cfg.world_size} x {cfg.accumulation_steps} x {cfg.micro_batch_size} now: {same} "
            f"({saved['batch_size']} before, {cfg.batch_size} now)")


def fingerprint(data) -> str:
    """A short hash of the samples (0.2 s for CIFAR-100's 150 MB), stored in checkpoints: a resume on other data is
    refused, whatever the flags or data dir say. A Dataset (not read whole): its `targets`, first and last samples."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(getattr(data, "images", None), torch.Tensor):  # ImageData
        h.update(data.labels.numpy().tobytes())
        h.update(data.images.contiguous().numpy().data)
    else:
        if getattr(data, "targets", None) is not None:
            h.update(torch.as_tensor(data.targets, dtype=torch.int64).numpy().tobytes())
        for i in sorted({0, len(data) - 1}):
            item = read_sample(data, i, "")
            if not isinstance(item, tuple):  # a BadSample: the kind of failure stands for it (no line numbers)
                h.update(item.reason.split(":", 1)[0].encode())
            else:
                h.update(item[0].contiguous().numpy().tobytes() + str(int(item[1])).encode())
    return f"{len(data)}:{h.hexdigest()}"


def check_same_splits(fingerprints: dict) -> None:
    """Every rank must hold the same splits (name: fingerprint), which the samplers shard by rank: a split that differs
    by rank would train some samples twice and others never, and score another test set per rank. A UserError on every
    rank, else."""
    ranks = all_gather(fingerprints)  # a short string per split: the cost of one small collective
    for rank, theirs in enumerate(ranks):
        for name, mine in theirs.items():
            if mine != ranks[0][name]:
                (n, h), (n0, h0) = mine.split(":"), ranks[0][name].split(":")
                raise UserError(f"the {name} split differs by rank: rank {rank} loaded {n} samples (fingerprint {h}), "
                                f"rank 0 {n0} ({h0}); load_data must return the same splits on every rank (the "
                                f"samplers share them out): it must not depend on env.rank, and a random split "
                                f"needs a fixed seed")
