"""Data checks that need no knowledge of the recipe's data contract: classes, channel statistics, worker sockets."""
import multiprocessing.connection
import os
import sys

import torch

from machinery.errors import UserError


# A Unix socket's longest path: sun_path less its closing zero (108 bytes on Linux, 104 on macOS and the BSDs).
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103


def check_worker_sockets(workers: int) -> None:
    """UserError if the loader workers' forkserver socket in TMPDIR would have a path over SOCKET_PATH_MAX bytes."""
    if not workers:
        return
    path = os.fsencode(multiprocessing.connection.arbitrary_address("AF_UNIX"))  # as the forkserver names it
    if len(path) > SOCKET_PATH_MAX:
        folder = os.path.dirname(os.path.dirname(path))  # the socket is <TMPDIR>/pymp-XXXXXXXX/<name>
        fits = SOCKET_PATH_MAX - (len(path) - len(folder))
        raise UserError(f"the temporary folder {os.fsdecode(folder)} (TMPDIR, {len(folder)} bytes) is too long "
                        f"a path for the DataLoader workers' socket in it ({len(path)} bytes; a socket takes "
                        f"{SOCKET_PATH_MAX}, so TMPDIR at most {fits}): set TMPDIR to a shorter folder (export "
                        f"TMPDIR=/tmp) or run with --workers 0")


def stated_classes(split) -> int | None:
    """The number of classes a split states: num_classes, or the length of its `classes` list."""
    if getattr(split, "num_classes", None):
        return split.num_classes
    names = class_names(split)
    return len(names) if names else None


def class_names(split) -> tuple | None:
    """The names a split gives its classes, index by index (`classes`, as in torchvision's datasets), if any."""
    names = getattr(split, "classes", None)
    return tuple(map(str, names)) if isinstance(names, (list, tuple)) and len(names) else None


def check_same_classes(names, test, source: str) -> None:
    """UserError unless each class the test split names has its index in `names` (the training split's or the
    checkpoint's), by its `class_to_idx` if any, else by the order of `classes`. ImageFolder numbers the folders it
    finds, sorted: a missing or misspelled test folder silently relabels every later class (missing last ones don't)."""
    mapping = getattr(test, "class_to_idx", None)
    test_index = ({str(c): i for c, i in mapping.items()} if isinstance(mapping, dict) and mapping else
                  {c: i for i, c in enumerate(class_names(test) or ())})
    index = {c: i for i, c in enumerate(names or ())}
    if not index or not test_index or all(index.get(c) == i for c, i in test_index.items()):
        return
    lacks, extra = [c for c in index if c not in test_index], [c for c in test_index if c not in index]

    def listed(classes):
        return ", ".join(map(repr, classes[:3])) + (f" and {len(classes) - 3} more" if len(classes) > 3
                                                    else "")
    found = [f"lacks {listed(lacks)}"] if lacks else []
    found += [f"has {listed(extra)}, which {source} lacks"] if extra else []
    what = " and ".join(found) if found else "numbers the same classes otherwise"
    fix = ("rename or remove the test split's class folders that training lacks" if extra and not lacks else
           "fix the folder names, or number the test split by the training classes: "
           "dataset_utils.image_folder(path, classes=...) (README, Adapt it)")
    raise UserError(f"the test split's classes are not {source}'s: it {what}, so its labels would name other "
                    f"classes (ImageFolder numbers the class folders it finds); {fix}")


def channel_stats(images: torch.Tensor) -> tuple:
    """Per-channel mean and std of uint8 images (N, C, H, W), as fractions of 255 (exact: mean_std_of_sums)."""
    total = torch.zeros(images.shape[1], dtype=torch.int64)
    squares = torch.zeros_like(total)
    for chunk in images.split(4096):  # int64 copies of 4096 images at a time, not of the whole set
        x = chunk.to(torch.int64)
        total += x.sum(dim=(0, 2, 3))
        squares += (x * x).sum(dim=(0, 2, 3))
    return mean_std_of_sums(total, squares, images.numel() // images.shape[1])


def mean_std_of_sums(total: torch.Tensor, squares: torch.Tensor, count: int) -> tuple:
    """Per-channel mean and std / 255 from the integer sums of pixels and of squares (`count` per channel): exact,
    so the same on every rank whatever its threads."""
    mean = total.double() / count
    std = (squares.double() / count - mean ** 2).clamp_min(0).sqrt()
    std = torch.where(std > 0, std, 255.0)  # a constant channel: leave its scale alone
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())


def folder_classes(root) -> list:
    """The classes of an image folder root/<class>/<image>: its subfolders' names, sorted, less those starting with
    "." (.ipynb_checkpoints). Give them to image_folder for both splits, so that labels mean the same."""
    try:
        names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError as e:
        raise UserError(f"cannot read the image folder {root} ({e.strerror}): --data-dir must hold train/ "
                        f"and test/, each with one folder of images per class") from None
    if not names:
        raise UserError(f"the image folder {root} holds no class folders: it needs one folder of images per "
                        f"class, {root}/<class>/<image>")
    return names
