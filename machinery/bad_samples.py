"""Samples that do not read: BadSamples, skipped or stopped on by all ranks (check_unreadable)."""
import os
import re
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Subset

from machinery.errors import UserError, all_gather, all_reduce_max
from machinery.hashing import seeded
from machinery.output import log


class Share(Subset):
    """A share of a load_data split (hold_out): its bad samples named by their index in it."""


def first_readable(split, name: str, tries: int = 10) -> tuple:
    """(sample, index) of the first sample that reads, of the first `tries`; else UserError."""
    for i in range(min(tries, len(split))):
        try:
            return split[i], i
        except Exception as e:  # noqa: BLE001 - said, with where it was raised
            error = bad_sample(split, i, name, describe_exception(e))
    raise UserError(f"load_data's {name} split: none of its first {min(tries, len(split))} samples reads; "
                    f"the last: {error.describe()}; {error.fix}")


@dataclass(frozen=True)
class BadSample:
    """A sample the loader could not take, in its place (`slot` in the batch)."""
    split: str
    index: int
    file: str | None
    reason: str
    fix: str = "fix or remove the file"
    slot: int = -1

    def describe(self) -> str:
        held = self.split == "validation"  # a training sample that --val-size held out
        notes = [note for note in (self.file, "held out for validation" if held else None) if note]
        where = f" ({', '.join(notes)})" if notes else ""
        return f"{'training' if held else self.split} sample {self.index}{where}: {self.reason}"


def bad_sample(data, idx: int, split: str, reason: str, **fix) -> BadSample:
    """Sample `idx`'s BadSample, named by its index in load_data's split, and its file."""
    while isinstance(data, Share):
        data, idx = data.dataset, data.indices[idx]
    index = idx
    while isinstance(data, Subset):
        data, idx = data.dataset, data.indices[idx]
    samples = getattr(data, "samples", None) or getattr(data, "imgs", None)  # ImageFolder's (file, label)s, or paths
    entry = samples[idx] if isinstance(samples, (list, tuple)) and 0 <= idx < len(samples) else None
    file = None if entry is None else str(entry[0] if isinstance(entry, (tuple, list)) else entry)
    if file and os.path.basename(file).startswith("._") and not fix:  # from a Mac's tar
        fix = {"fix": f"it is a Mac's AppleDouble metadata file, not an image: delete them (find "
                      f"{getattr(data, 'root', 'DIR')} -name '._*' -delete), or use dataset_utils.image_folder"}
    elif file and os.path.islink(file) and not os.path.exists(file) and not fix:
        fix = {"fix": f"it is a symbolic link to {os.readlink(file)}, which does not exist: restore that "
                      f"file, or remove the link"}
    return BadSample(split, index, file, reason, **fix)


def read_sample(data, idx: int, split: str, shape: tuple | None = None):
    """data[idx] as (uint8 image, label), of `shape` if given (None: any); else a BadSample."""
    try:
        image, label = data[idx]
    except Exception as e:  # noqa: BLE001 - named, with where it was raised
        return bad_sample(data, idx, split, describe_exception(e))
    if shape is not None and not (isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3
                                  and all(want in (None, got) for want, got in zip(shape, image.shape))):
        want = f"{shape[0]} x H x W" if shape[1] is None else " x ".join(map(str, shape))
        return bad_sample(data, idx, split, f"an image of {describe_image(image)}, not {want} uint8 like the first",
                          fix=f"make every image {want}: {resize_fix(data, shape)}" if shape[1] is not None else
                          f"give every image {shape[0]} channel(s) in load_data (dataset_utils.image_folder's mode=)")
    return image, label


def transform_sample(data, idx: int, split: str, transform, image: torch.Tensor, seed: int, shape: tuple):
    """`image` through `transform`, seeded: uint8 of `shape`, else a BadSample."""
    what = f"the {'training' if split == 'training' else 'test'} transform (build_transforms in train_ddp.py)"
    try:
        out = seeded(transform, (image,), seed)
    except Exception as e:  # noqa: BLE001 - named, with where it was raised
        return bad_sample(data, idx, split, f"{what} failed on its {describe_image(image)} image: "
                          f"{describe_exception(e)}", fix=f"make {what} take every image")
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and tuple(out.shape) == tuple(shape)):
        want = " x ".join(map(str, shape))
        return bad_sample(data, idx, split, f"{what} returned {describe_image(out)} for its "
                          f"{describe_image(image)} image, not the model's {want} uint8",
                          fix=f"make it return {want} uint8 for every image (e.g. end with v2.Resize({shape[1]}) "
                              f"and v2.CenterCrop(({shape[1]}, {shape[2]})))")
    return out


def transform_image(transform, image: torch.Tensor, *, idx: int, split: str, shape: tuple, seed: int):
    """transform_sample for data in memory, not skipped: UserError for a BadSample."""
    out = transform_sample(None, idx, split, transform, image, seed=seed, shape=shape)
    if not isinstance(out, torch.Tensor):
        raise UserError(f"{out.describe()}; {out.fix}")
    return out


def describe_image(image) -> str:  # "3 x 32 x 32 uint8" for a tensor, else "a module.Type"
    if isinstance(image, torch.Tensor):
        return " x ".join(map(str, image.shape)) + f" {str(image.dtype).removeprefix('torch.')}"
    return f"a {type(image).__module__}.{type(image).__name__}"


def resize_fix(split, shape: tuple) -> str:  # in the words of how load_data reads `split`
    while isinstance(split, Subset):
        split = split.dataset
    size = f"({shape[1]}, {shape[2]})"
    if hasattr(split, "resize_to"):  # dataset_utils.image_folder's folders
        return f"size={size} in both dataset_utils.image_folder calls of load_data"
    if isinstance(getattr(split, "images", None), torch.Tensor):  # ImageData
        return f"resize both splits' images to {size} in load_data (v2.functional.resize(images, {list(shape[1:])}))"
    return f"in load_data, end both splits' transform with v2.Resize({size})"


def describe_exception(e: Exception) -> str:
    """`Type: its message's first line (at file.py:line)`, where it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    message = re.sub(r" ?<_io\.\w+ name='[^']*'>", "", str(e).splitlines()[0])[:200] if str(e) else ""  # PIL
    return f"{type(e).__name__}: {message}{where}" if message else f"{type(e).__name__}{where}"


def check_unreadable(found: list, *, skipped: list, limit: int) -> None:
    """Collective: `found` (emptied) logged into `skipped`; UserError past `limit` or for a test sample."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"  # NCCL: CUDA tensors only
    if not all_reduce_max(torch.tensor([len(found)], device=torch.cuda.current_device() if nccl else "cpu")).item():
        return  # one small all-reduce; a gather only if any
    new = sorted((bad for mine in all_gather(list(found)) for bad in mine),
                 key=lambda bad: (bad.split, bad.index))
    found.clear()
    first = new[0]
    if first.split != "training":
        raise UserError(f"{first.describe()}; {first.fix} (the {first.split} set is scored whole: "
                        f"--skip-bad-samples skips the samples trained on only)")
    if not limit:
        raise UserError(f"{first.describe()}; {first.fix}, or skip such samples with --skip-bad-samples N")
    over = len(skipped) + len(new) > limit
    for bad in new:  # each named, those past the limit too
        skipped.append(bad.describe())
        log(f"warning: {'unreadable' if over else 'skipped'} {skipped[-1]} ({len(skipped)}, at most {limit} an epoch)")
    if over:
        raise UserError(f"more than {limit} unreadable training samples this epoch (--skip-bad-samples {limit}; the "
                        f"log names them), the last {new[-1].describe()}; {new[-1].fix}, or raise --skip-bad-samples")
