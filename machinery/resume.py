"""What a resume checks: the format, the flags (RESUME_RULES), the device, a finished run, the data, the model."""

import hashlib
import json
import os
from contextlib import suppress

import torch

from machinery.checkpoints import ANY, DATA, NOTED, RECIPE
from machinery.bad_samples import read_sample
from machinery.errors import UserError, all_gather
from machinery.output import log

REQUIRED_KEYS = ("progress", "config", "model_config", "data", "world_size", "rng_cpu", "rng_cuda")
REQUIRED_CONFIG_KEYS = ("data_spec", "epochs", "batch_size", "per_rank_batch", "accumulation_steps",
                        "micro_batch", "micro_batch_size", "lr", "device_type")
# train_utils.Progress's fields (a unit test holds the two together).
REQUIRED_PROGRESS_KEYS = ("epoch", "position", "step", "sums", "elapsed_s", "history", "total_time_s",
                          "total_images", "stopped_early")
OPTIONAL_PROGRESS_KEYS = ("skipped",)  # added later, with a default exact for older checkpoints (none skipped)


def check_format(ckpt, path: str, required=()) -> None:
    """UserError unless `ckpt` holds every key this version reads: never half-read with guessed defaults."""
    missing = [k for k in REQUIRED_KEYS + tuple(required) if k not in ckpt]
    missing += [f"config.{k}" for k in REQUIRED_CONFIG_KEYS if k not in ckpt.get("config", {})]
    missing += [f"progress.{k}" for k in REQUIRED_PROGRESS_KEYS if k not in ckpt.get("progress", {})]
    if missing:
        raise UserError(f"{path} was written by an older train_ddp.py (it lacks {', '.join(missing[:3])}); "
                        f"evaluate or resume it with that version, or train afresh in another --out-dir")


def checkpoint_flags(args, explicit: set, ckpt, rules: dict) -> tuple:
    """The flags to continue `ckpt` with, by each flag's rule (RESUME_RULES), and notes on what changed; UserError
    where the data, model or recipe differ. --evaluate takes unset flags from `ckpt`, any recipe and --test-size."""
    flags = dict(vars(args))
    saved, evaluate, out = ckpt["config"], flags["evaluate"], flags["out_dir"]
    rules = {k: rule if isinstance(rule, tuple) else (rule, None) for k, rule in rules.items()}
    if evaluate:
        flags.update({k: v for k, v in saved.items() if k in flags and k not in explicit | {"evaluate", "out_dir"}})
    elif "micro_batch" not in explicit:  # the checkpoint's per-rank memory cap: fewer GPUs keep their memory
        flags["micro_batch"] = saved["micro_batch"] or saved["micro_batch_size"]
    model_flags = {k for k in ckpt["model_config"] if k in flags}  # the flags build_model's shapes follow
    for key, (rule, before) in rules.items():
        old, new, flag = saved.get(key, before), flags.get(key), "--" + key.replace("_", "-")
        if key not in flags or new == old or old is ANY or (evaluate and (rule == RECIPE or key == "test_size")):
            continue
        # a RECIPE flag the checkpoint lacks (before None) was off: only turning it on changes the run
        if ((rule == DATA or key in model_flags) and old is not None) or (rule == RECIPE and (key in saved or new)):
            what = "on other data" if rule == DATA else "another model" if key in model_flags else "with another recipe"
            keep = f"leave {flag} out" if old is None or old is False else f"{flag} {old}"
            raise UserError(f"{flag} {new} differs from the {old} of the checkpoint in {out}, which trained {what}: "
                            f"use another --out-dir for a new run, or {keep} to continue it")
    changed = [f"--{k.replace('_', '-')} {saved[k]} -> {v}" for k, v in flags.items()
               if k in saved and rules.get(k, (NOTED,))[0] == NOTED and k not in model_flags and saved[k] != v
               and (k != "micro_batch" or k in explicit) and not evaluate]  # a kept memory cap is no change
    return flags, ["resumed with changes: " + ", ".join(changed)] if changed else []


def check_same_device(ckpt, path: str, device: torch.device, evaluate_only: bool) -> None:
    trained_on = ckpt["config"]["device_type"]
    if trained_on != device.type and not evaluate_only:  # optimizer state and RNGs belong to the device type
        raise UserError(f"{path} was trained on {trained_on}, and this run is on {device.type}: resume with "
                        f"--device {trained_on}, or train afresh in another --out-dir")


def check_finished(ckpt, path: str, flags: dict, notes: list) -> str | None:
    """None if `ckpt` has epochs left or its records are not whole; the line to log if rerun as it was; else raises."""
    progress, saved, epochs = ckpt["progress"], ckpt["config"], flags["epochs"]
    done, early, history = progress["epoch"], progress["stopped_early"], progress["history"]
    if not early and done < epochs:
        return None
    result = (f"; final validation accuracy {history[-1]['val_acc']:.4f}, best "
              f"{max(m['val_acc'] for m in history):.4f}" if history else "")
    holds = (f"{path} holds a run that stopped early at epoch {done} (target accuracy reached{result})"
             if early else f"{path} holds a run trained for {done} epochs{result}")
    ways = ("" if early else f"--epochs N (more than {done}) trains it on, or ") + "another --out-dir starts afresh"
    if not notes and epochs == saved["epochs"]:
        summary = {}
        with suppress(OSError, ValueError), open(os.path.join(flags["out_dir"], "summary.json")) as f:
            summary = json.load(f)
        whole = summary.get("finished") and summary.get("epochs_completed") == done  # else this run writes them
        return f"{holds}: nothing to train; {ways}." if whole else None
    if epochs != saved["epochs"] and epochs <= done:
        raise UserError(f"--epochs {epochs} leaves nothing to train: {holds}; {ways}")
    raise UserError(f"{holds}, and this command changes it ({'; '.join(notes)}) but trains nothing: {ways}")


def check_same_data(found, shape: dict, fingerprints: dict) -> None:
    def describe_shape(shape: dict) -> str:  # "3 x 32 x 32 images of 100 classes", or "3-channel images"
        size = " x ".join(str(shape[k]) for k in ("channels", "height", "width") if k in shape)
        classes = f" of {shape['num_classes']} classes" if "num_classes" in shape else ""
        return f"{size} images{classes}" if "height" in shape else f"{size}-channel images{classes}"
    out, data_dir = found.flags["out_dir"], found.flags["data_dir"]
    saved_shape = {k: found.ckpt["config"]["data_spec"][k] for k in shape}
    if saved_shape != shape:
        raise UserError(f"load_data gives {describe_shape(shape)}, but the checkpoint in {out} was trained on "
                        f"{describe_shape(saved_shape)}: use another --out-dir, or load the data it trained on")
    saved = found.ckpt["data"]
    for split, fp in fingerprints.items():
        if split == "test" and found.flags.get("test_size") != found.ckpt["config"]["test_size"]:
            continue  # --evaluate --test-size N scores another share of the test set, on purpose
        if saved[split] != fp:
            raise UserError(f"the {split} data in --data-dir {data_dir} differ from those the checkpoint in {out} was "
                            f"trained on (fingerprint {fp}, checkpoint {saved[split]}): use those or another --out-dir")


def check_same_model(found, model_config: dict) -> None:
    if found.ckpt["model_config"] != model_config:
        raise UserError(f"{found.path} holds {found.describe_model()}; this run builds {describe_model(model_config)} "
                        f"(model_config in train_ddp.py): build the same model, or use another --out-dir")


def describe_model(cfg: dict) -> str:  # its "name" (else its keys and values), and its classes
    name = cfg.get("name") or ", ".join(f"{k} {v}" for k, v in cfg.items() if k != "num_classes")
    return f"{name} with {cfg['num_classes']} classes" if "num_classes" in cfg else name


def note_resume_changes(saved: dict, cfg, progress, draws: str) -> None:
    before = saved.get("draws", "a hash of (seed, epoch, index), in the project's own ops (before torchvision's)")
    if before != draws and draws:
        log(f"note: the augmentation drew from {before} before, from {draws} now: as good, not bit-identical")
    if saved["lr"] != cfg.lr:
        log(f"note: the peak LR changed from {saved['lr']:.4g} to {cfg.lr:.4g} on resume")
    if saved["batch_size"] != cfg.batch_size:
        log(f"note: the global batch changed from {saved['batch_size']} to {cfg.batch_size} on resume: the schedule "
            f"keeps its place in samples (epoch {progress.epoch + 1} resumes at sample {progress.position})")
    before = (saved["world_size"], saved["accumulation_steps"], saved["micro_batch_size"])
    if before != (cfg.world_size, cfg.accumulation_steps, cfg.micro_batch_size):
        same = "the same global batch" if saved["batch_size"] == cfg.batch_size else "another global batch"
        log(f"note: {before[0]} ranks x {before[1]} accumulation steps x {before[2]} before, {cfg.world_size} x "
            f"{cfg.accumulation_steps} x {cfg.micro_batch_size} now: {same}")


def fingerprint(data) -> str:
    """A short hash of the samples (0.2 s for CIFAR-100), kept in checkpoints; a Dataset's targets, first and last."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(getattr(data, "images", None), torch.Tensor):  # ImageData
        h.update(data.labels.numpy().tobytes())
        h.update(data.images.contiguous().numpy().data)
    else:
        if getattr(data, "targets", None) is not None:
            h.update(torch.as_tensor(data.targets, dtype=torch.int64).numpy().tobytes())
        for i in sorted({0, len(data) - 1}):
            item = read_sample(data, i, "")  # or a BadSample: its kind of failure (no line numbers)
            h.update(item[0].contiguous().numpy().tobytes() + str(int(item[1])).encode() if isinstance(item, tuple)
                     else item.reason.split(":", 1)[0].encode())
    return f"{len(data)}:{h.hexdigest()}"


def check_same_splits(fingerprints: dict) -> None:
    """UserError unless every rank holds the same splits (name: fingerprint): the samplers shard them."""
    ranks = all_gather(fingerprints)  # a short string per split: one small collective
    for rank, theirs in enumerate(ranks):
        for name, mine in theirs.items():
            if mine != ranks[0][name]:
                (n, h), (n0, h0) = mine.split(":"), ranks[0][name].split(":")
                raise UserError(f"the {name} split differs by rank: rank {rank} loaded {n} samples (fingerprint {h}), "
                                f"rank 0 {n0} ({h0}); load_data must not use env.rank, and must seed a random split")
