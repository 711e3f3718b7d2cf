"""What the data load_data returned say of themselves (measure_data: shape, classes, mean and std), the checks
that they are what the loaders take and what a checkpoint trained on (fingerprints), where the loaders keep them
(loader_device, with the check that DataLoader workers can start), and --val-size's held-out split."""
import hashlib
import multiprocessing.connection
import numbers
import os
import sys
from dataclasses import dataclass, replace

import torch
from torch.utils.data import Subset

from dataset_utils import DataSpec, ImageData, data_device
from machinery.bad_samples import BadSample, Share, first_readable, read_sample, resize_fix
from machinery.checkpoints import check_same_data
from machinery.errors import UserError, call_and_agree


def measure_data(train, test) -> DataSpec:
    """What the splits that load_data returned say of themselves: an image's channels, height and width,
    the number of classes, and the training split's per-channel mean and std. What a split states is
    taken as stated (ImageData's fields; a Dataset's `num_classes`, `mean` and `std` attributes, or
    its `classes` list as torchvision's datasets have); ImageData's rest is computed, from exact integer
    sums, so that every rank gets the same numbers. A Dataset (too large to read twice) states its mean
    and std. Raises UserError, naming load_data, if the splits are not what the loaders take."""
    check_same_classes(class_names(train), test, "the training split")  # first: it reads no sample
    shape, test_shape = check_split(train, "training"), check_split(test, "test")
    if test_shape != shape:
        fix = (f"give both {shape[0]} channels in load_data" if test_shape[0] != shape[0] else
               f"give the test images the training images' size: {resize_fix(test, shape)}")
        raise UserError(f"load_data returned training images of {' x '.join(map(str, shape))} but test "
                        f"images of {' x '.join(map(str, test_shape))} (channels x height x width): both "
                        f"splits must hold images of one shape; {fix}")
    num_classes = stated_classes(train) or stated_classes(test) or count_classes(train, test)
    for split, name in ((train, "training"), (test, "test")):
        labels = split.labels if isinstance(split, ImageData) else getattr(split, "targets", None)
        if labels is None or not len(labels):
            continue
        low, high = int(torch.as_tensor(labels).min()), int(torch.as_tensor(labels).max())  # tensor ops: fast
        if not 0 <= low <= high < num_classes:
            raise UserError(f"load_data's {name} labels span [{low}, {high}], outside [0, {num_classes}) for "
                            f"{num_classes} classes: labels must be class indices 0, 1, ...")
    mean, std = getattr(train, "mean", None), getattr(train, "std", None)
    if mean is None or std is None:
        if not isinstance(train, ImageData):
            raise UserError(f"load_data's training {type(train).__name__} states no per-channel mean and "
                            f"std, and computing them would read all of it: set its .mean and .std (tuples "
                            f"of {shape[0]} fractions of 255) in load_data")
        mean, std = channel_stats(train.images)
    if len(mean) != shape[0] or len(std) != shape[0] or min(std) <= 0:
        raise UserError(f"load_data states mean {tuple(mean)} and std {tuple(std)}: each needs {shape[0]} "
                        f"values (one per channel), and std must be positive")
    return DataSpec(*shape, num_classes=int(num_classes), mean=tuple(map(float, mean)),
                    std=tuple(map(float, std)), classes=class_names(train))


@dataclass
class CheckedData:
    """The splits load_data returned (train: None for --evaluate), what they say of themselves, and their
    fingerprints, checked against the checkpoint a run continues."""
    train: object
    test: object
    spec: DataSpec
    fingerprints: dict
    device: object  # where the loaders keep the data: a torch.device, or None for DataLoader workers
    val: object = None  # --val-size: the training samples held out to validate on (hold_out)
    source: str = ""  # what load_data returned and where from, for the records (describe_source)


def load_checked_data(load_data, cfg, env, found, train: bool = True) -> CheckedData:
    """load_data(cfg, env, train) on every rank, measured (measure_data) and checked to be the data the
    checkpoint in `found` trained on; every rank raises the UserError that says why not. Without the
    training split (--evaluate) the spec is the checkpoint's: the training set's mean and std."""
    train_data, test_data = call_and_agree(load_data, cfg, env, train)
    if train:
        spec = call_and_agree(measure_data, train_data, test_data)
        shape = spec.shape()
    else:
        shape = dict(zip(("channels", "height", "width"), call_and_agree(check_split, test_data, "test")))
        spec = DataSpec(**found.ckpt["config"]["data_spec"])
        call_and_agree(check_same_classes, spec.classes, test_data, "the checkpoint's training split")
    splits = {"train": train_data, "test": test_data} if train else {"test": test_data}
    fingerprints = {name: fingerprint(split) for name, split in splits.items()}
    call_and_agree(check_same_data, found, shape, fingerprints)  # never continue on other data
    device = loader_device(cfg, env, *splits.values())
    source = describe_source(train_data if train else test_data)
    val_data = None
    if train and cfg.val_size:
        train_data, val_data = call_and_agree(hold_out, train_data, cfg.val_size)
    return CheckedData(train_data, test_data, spec, fingerprints, device, val_data, source)


def loader_device(cfg, env, *splits):
    """dataset_utils.data_device, agreed by every rank; for DataLoader workers (None), also the check that they
    can start here (check_worker_sockets)."""
    device = call_and_agree(data_device, cfg.loader, env.device, *splits)
    if device is None:
        call_and_agree(check_worker_sockets, cfg.num_workers)
    return device


# A Unix socket's longest path: sun_path less its closing zero (108 bytes on Linux, 104 on macOS and the BSDs).
SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103


def check_worker_sockets(workers: int) -> None:
    """Raise UserError if the loader workers could not start here: their forkserver listens on a Unix socket in
    the temporary folder (TMPDIR), and a socket's path takes at most SOCKET_PATH_MAX bytes."""
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


def describe_source(split) -> str:
    """What load_data returned and where from, as the records name it: ImageData's `source` (CIFAR-100 in a
    dir, synthetic), or a Dataset's class and its `root`."""
    while isinstance(split, Subset):
        split = split.dataset
    if isinstance(split, ImageData):
        return split.source or "ImageData from load_data"
    root = getattr(split, "root", None)
    return f"{type(split).__name__} of {root}" if root else f"{type(split).__name__} from load_data"


def hold_out(train, size: int) -> tuple:
    """(the rest, `size` samples held out) of the training split: the same samples on every rank and in every
    run of these data, whatever --seed (a fixed permutation), so that runs compare on one validation split.
    The data's statistics (DataSpec) stay those of the whole split as loaded."""
    if size >= len(train):
        raise UserError(f"--val-size {size} leaves no training samples of the {len(train)}: hold out fewer")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    kept, held = order[size:].sort().values, order[:size].sort().values
    if isinstance(train, ImageData):
        return (replace(train, images=train.images[kept], labels=train.labels[kept]),
                replace(train, images=train.images[held], labels=train.labels[held]))
    return Share(train, kept.tolist()), Share(train, held.tolist())


def check_split(split, name: str) -> tuple:
    """(channels, height, width) of a split's images; UserError if it is not ImageData of uint8 images
    (N, C, H, W) and int64 labels (N,), or a Dataset of (uint8 C x H x W tensor, integer label)."""
    if isinstance(split, ImageData):
        images, labels = split.images, split.labels
        if (images.dtype != torch.uint8 or images.dim() != 4 or labels.dtype != torch.int64
                or labels.shape != (len(images),)):
            raise UserError(f"load_data's {name} ImageData holds images {tuple(images.shape)} {images.dtype} "
                            f"and labels {tuple(labels.shape)} {labels.dtype}: it needs uint8 images "
                            f"(N, C, H, W) and int64 labels (N,)")
        if len(images) == 0:
            raise UserError(f"load_data's {name} split is empty")
        return tuple(images.shape[1:])
    if not (hasattr(split, "__getitem__") and hasattr(split, "__len__")):
        raise UserError(f"load_data returned a {type(split).__name__} as the {name} split: return "
                        f"dataset_utils.ImageData, or a Dataset of (uint8 C x H x W tensor, label)")
    if len(split) == 0:
        raise UserError(f"load_data's {name} split is empty")
    item, first = first_readable(split, name)
    image, label = item if isinstance(item, (tuple, list)) and len(item) == 2 else (item, None)
    integer_label = isinstance(label, numbers.Integral) or (
        isinstance(label, torch.Tensor) and label.dim() == 0 and not label.is_floating_point())
    if (not (isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3)
            or not integer_label):
        got = (f"{type(image).__name__} {tuple(getattr(image, 'shape', ()))} "
               f"{getattr(image, 'dtype', '')}").strip()
        raise UserError(f"load_data's {name} {type(split).__name__} yields ({got}, {type(label).__name__}) "
                        f"as item {first}: it must yield (uint8 tensor C x H x W, integer label); for image "
                        f"files, ImageFolder(root, transform=torchvision.transforms.v2.PILToTensor())")
    return tuple(image.shape)


def stated_classes(split) -> int | None:
    """The number of classes a split states: num_classes, or the length of its `classes` list."""
    if getattr(split, "num_classes", None):
        return split.num_classes
    names = class_names(split)
    return len(names) if names else None


def class_names(split) -> tuple | None:
    """The names a split gives its classes, index by index (`classes`, as torchvision's datasets have it), if
    any."""
    names = getattr(split, "classes", None)
    return tuple(map(str, names)) if isinstance(names, (list, tuple)) and len(names) else None


def check_same_classes(names, test, source: str) -> None:
    """UserError unless every class the test split names has the index it has in `names` (the training
    split's, or the checkpoint's): by its `class_to_idx` where it has one (a split numbered by hand), else by
    the order of its `classes`. ImageFolder numbers the class folders it finds, in sorted order: a test folder
    that lacks one, or spells one otherwise, gives every later class's images another class's label, and a
    good model a bad score, without a word. (A test split that lacks only the last classes shifts nothing.)"""
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


def count_classes(train, test) -> int:
    """1 + the largest label of either split (a Dataset must list its labels as `targets`)."""
    highest = []
    for split in (train, test):
        labels = split.labels if isinstance(split, ImageData) else getattr(split, "targets", None)
        if labels is None:
            raise UserError(f"load_data's {type(split).__name__} states no number of classes: set its "
                            f".num_classes (or .classes, or .targets, the list of its labels) in load_data")
        highest.append(int(torch.as_tensor(labels).max()))
    return max(highest) + 1


def channel_stats(images: torch.Tensor) -> tuple:
    """Per-channel mean and std of uint8 images (N, C, H, W), as fractions of 255. Integer sums are exact,
    so the result is the same on every rank, whatever its threads."""
    total = torch.zeros(images.shape[1], dtype=torch.int64)
    squares = torch.zeros_like(total)
    for chunk in images.split(4096):  # int64 copies of 4096 images at a time, not of the whole set
        x = chunk.to(torch.int64)
        total += x.sum(dim=(0, 2, 3))
        squares += (x * x).sum(dim=(0, 2, 3))
    return mean_std_of_sums(total, squares, images.numel() // images.shape[1])


def fingerprint(data) -> str:
    """A short hash of the samples themselves (about 0.2 s for CIFAR-100's 150 MB), stored in every
    checkpoint: a resume on other data is refused, whatever the flags or the data dir say. Of a Dataset
    (not read whole), its labels if it lists them as `targets`, and its first and last samples."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(data, ImageData):
        h.update(data.labels.numpy().tobytes())
        h.update(data.images.contiguous().numpy().data)
    else:
        if getattr(data, "targets", None) is not None:
            h.update(torch.as_tensor(data.targets, dtype=torch.int64).numpy().tobytes())
        for i in sorted({0, len(data) - 1}):
            item = read_sample(data, i, "")
            if isinstance(item, BadSample):  # unreadable: the kind of failure stands for it (no line numbers)
                h.update(item.reason.split(":", 1)[0].encode())
            else:
                h.update(item[0].contiguous().numpy().tobytes() + str(int(item[1])).encode())
    return f"{len(data)}:{h.hexdigest()}"


def mean_std_of_sums(total: torch.Tensor, squares: torch.Tensor, count: int) -> tuple:
    """Per-channel mean and std, as fractions of 255, from the integer sums of uint8 pixels and of their
    squares over `count` pixels per channel: exact, so the same on every rank whatever its threads."""
    mean = total.double() / count
    std = (squares.double() / count - mean ** 2).clamp_min(0).sqrt()
    std = torch.where(std > 0, std, 255.0)  # a constant channel: leave its scale alone
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())

