"""The data: CIFAR-100 (or learnable synthetic data of its shape) as uint8 tensors, what any
data say of themselves (DataSpec), and the DDP data loaders.

Whatever `load_data` in train_ddp.py returns decides the rest: the model's input channels and
classes, the normalisation's mean and std, and the augmentation's crop, all from `measure_data`.

The images stay uint8 until they reach the device: the loader workers only crop
and flip, and normalisation runs on the device in `Normalize`. That keeps the
CPU cost per image tiny, which matters on clusters with few cores per GPU.

Random augmentation is a pure function of (seed, epoch, sample index), so it does
not depend on the number of ranks or workers, or on whether the run was resumed.
"""
import functools
import hashlib
import math
import numbers
import os
import pickle
import re
import socket
import tempfile
import traceback
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, Subset, default_collate
from torchvision.datasets import CIFAR100, ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
from torchvision.transforms.functional import pil_to_tensor
from torchvision.datasets.utils import check_integrity, download_url, extract_archive

from machinery.checkpoints import check_same_data
from machinery.errors import UserError, all_gather, call_and_agree
from machinery.output import log
from machinery.signals import deaf_to_stop_signals, stop_signals_held
from transforms import Augment, Mix, _signed, mix64

# The official archive, exactly as torchvision downloads and verifies it. CIFAR100_URL in the
# environment points at a mirror instead (the md5 check still applies).
CIFAR100_URL = os.environ.get("CIFAR100_URL", CIFAR100.url)
CIFAR100_ARCHIVE = CIFAR100.filename  # cifar-100-python.tar.gz
CIFAR100_MD5 = CIFAR100.tgz_md5
CIFAR100_FOLDER = CIFAR100.base_folder  # cifar-100-python
# What CIFAR-100 states of itself: its classes and its training set's per-channel statistics.
CIFAR100_CLASSES = 100
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


@dataclass
class ImageData:
    """One split held in memory: `images` uint8 (N, C, H, W), `labels` int64 (N,). It may state its
    number of classes and its per-channel mean and std (fractions of 255); measure_data computes
    what it does not state. Data too large for memory: a Dataset instead (see measure_data)."""
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int | None = None
    mean: tuple | None = None
    std: tuple | None = None

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class DataSpec:
    """What the data say of themselves; the model, the normalisation and the augmentation follow it.
    Stored in config.json and in every checkpoint: a resume on data of another shape is refused."""
    channels: int
    height: int
    width: int
    num_classes: int
    mean: tuple
    std: tuple
    classes: tuple | None = None  # the classes' names, index by index, where the training split names them

    def shape(self) -> dict:
        """What the model's shapes follow: an image's channels, height and width, and the classes."""
        return {"channels": self.channels, "height": self.height, "width": self.width, "num_classes": self.num_classes}


# ----------------------------------------------------------------------------- CIFAR-100 on disk

def prepare_cifar100(data_dir: str, env=None) -> None:
    """Make sure data_dir/cifar-100-python/ exists, on one process per node (the data dir may be
    node-local), while the other ranks wait: every rank raises the UserError that says why not. `env`:
    this process's DistEnv, or None for a lone process."""
    if env is None:
        return fetch_cifar100(data_dir)
    call_and_agree(fetch_cifar100, data_dir, here=env.local_rank == 0)


def fetch_cifar100(data_dir: str) -> None:
    """Extract data_dir/cifar-100-python.tar.gz if data_dir/cifar-100-python/ is not there, downloading
    it first if absent.

    The archive's md5 is checked before anything is extracted. Downloads and extractions go
    to a private temporary folder and are renamed into place, so processes on several nodes
    that share data_dir never see a half-written file.
    """
    folder = os.path.join(data_dir, CIFAR100_FOLDER)
    if all(os.path.isfile(os.path.join(folder, f)) for f in ("train", "test", "meta")):
        return
    archive = os.path.join(data_dir, CIFAR100_ARCHIVE)
    try:
        os.makedirs(data_dir, exist_ok=True)
        if not os.path.isfile(archive):
            _download(data_dir)
        if not check_integrity(archive, CIFAR100_MD5):
            raise UserError(
                f"{archive} fails its md5 check (expected {CIFAR100_MD5}): it is corrupt or incomplete; "
                f"delete it and run again to download it, or copy a good one there"
            )
        with tempfile.TemporaryDirectory(dir=data_dir, prefix=".extract-") as tmp:
            extract_archive(archive, tmp)
            if not os.path.isdir(os.path.join(tmp, CIFAR100_FOLDER)):
                raise UserError(f"{archive} does not contain {CIFAR100_FOLDER}/; delete it and download it again")
            try:
                os.rename(os.path.join(tmp, CIFAR100_FOLDER), folder)
            except OSError:
                if not os.path.isdir(folder):  # else another node won the race: fine
                    raise
    except OSError as e:
        raise UserError(f"cannot prepare CIFAR-100 in {data_dir}: {e}") from e


def _download(data_dir: str) -> None:
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".download-") as tmp:
        old_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(60)  # compute nodes without internet often drop packets: don't hang
        try:
            download_url(CIFAR100_URL, tmp, CIFAR100_ARCHIVE, md5=CIFAR100_MD5)
        except Exception as e:
            raise UserError(
                f"CIFAR-100 is not in {os.path.abspath(data_dir)} and downloading it failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"place {CIFAR100_ARCHIVE} (from {CIFAR100_URL}) in that directory, or use --dataset synthetic"
            ) from None
        finally:
            socket.setdefaulttimeout(old_timeout)
        os.replace(os.path.join(tmp, CIFAR100_ARCHIVE), os.path.join(data_dir, CIFAR100_ARCHIVE))


class _SafeUnpickler(pickle.Unpickler):
    """The CIFAR pickles hold dicts, lists and numpy arrays; refuse anything else."""
    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        return super().find_class(module, name)


def read_cifar100(data_dir: str, train: bool) -> ImageData:
    """Read the train or test pickle of the CIFAR-100 python version into uint8 tensors."""
    path = os.path.join(data_dir, CIFAR100_FOLDER, "train" if train else "test")
    try:
        with open(path, "rb") as f:
            entry = _SafeUnpickler(f, encoding="latin1").load()
        data = torch.as_tensor(entry["data"])
        labels = torch.as_tensor(entry["fine_labels"], dtype=torch.int64)
        n = labels.numel()
        if data.dtype != torch.uint8 or data.shape != (n, 3 * 32 * 32):
            raise ValueError(f"data is {tuple(data.shape)} {data.dtype}, expected ({n}, 3072) uint8")
        if n == 0 or labels.min() < 0 or labels.max() >= CIFAR100_CLASSES:
            raise ValueError(f"labels must lie in [0, {CIFAR100_CLASSES})")
    except Exception as e:
        raise UserError(
            f"{path} is unreadable ({type(e).__name__}: {e}); delete {os.path.dirname(path)} to extract it again"
        ) from None
    return ImageData(data.view(n, 3, 32, 32).contiguous(), labels, num_classes=CIFAR100_CLASSES,
                     mean=CIFAR100_MEAN, std=CIFAR100_STD)


def make_synthetic(n: int, train: bool, seed: int = 0) -> ImageData:
    """Images of CIFAR-100's shape and dtype whose class can be learned: each class has its own colour
    and grating (the same in both splits), and every image adds its own noise. For smoke runs, which
    then show learning, and for benchmarks, which do not look at the pixels."""
    classes = torch.Generator().manual_seed(1234)  # the class patterns: one set for train and test
    colour = torch.empty(CIFAR100_CLASSES, 3, 1, 1).uniform_(50, 205, generator=classes)
    freq = torch.randint(1, 4, (CIFAR100_CLASSES, 2, 1, 1), generator=classes).float()
    phase = torch.empty(CIFAR100_CLASSES, 1, 1).uniform_(0, 2 * math.pi, generator=classes)
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    grating = torch.sin(2 * math.pi * (freq[:, 0] * xx + freq[:, 1] * yy) / 32 + phase)  # (classes, 32, 32)
    patterns = colour + 45 * grating[:, None]
    g = torch.Generator().manual_seed(seed * 2 + int(train))
    labels = torch.randint(0, CIFAR100_CLASSES, (n,), dtype=torch.int64, generator=g)
    images = torch.empty(n, 3, 32, 32, dtype=torch.uint8)
    for chunk in torch.arange(n).split(8192):  # in chunks: 50,000 float images would take 600 MB
        noise = torch.randn(len(chunk), 3, 32, 32, generator=g) * 24
        images[chunk] = (patterns[labels[chunk]] + noise).round_().clamp_(0, 255).to(torch.uint8)
    return ImageData(images, labels, num_classes=CIFAR100_CLASSES)


# ----------------------------------------------------------------------------- image folders, as users have them


def folder_classes(root) -> list:
    """The classes of an image folder root/<class>/<image>: its subfolders' names, sorted, those that start with
    "." left out (.ipynb_checkpoints). Give them to image_folder for both splits, so that labels mean the same."""
    try:
        names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError as e:
        raise UserError(f"cannot read the image folder {root} ({e.strerror}): --data-dir must hold train/ and "
                        f"test/, each with one folder of images per class") from None
    if not names:
        raise UserError(f"the image folder {root} holds no class folders: it needs one folder of images per class, "
                        f"{root}/<class>/<image>")
    return names


def image_folder(root, classes: list | None = None, mode: str = "RGB") -> "ImageFolderSplit":
    """A split of image files, root/<class>/<image> (PNG, JPEG, ...): ImageFolderSplit."""
    return ImageFolderSplit(str(root), classes=classes, mode=mode)


class ImageFolderSplit(ImageFolder):
    """torchvision's ImageFolder, yielding (uint8 C x H x W tensor, label), for folders as users have them:
    - names that start with "." are left out, said in one line: a Mac's ._ files (AppleDouble metadata beside
      each file, which a tar or copy made on a Mac carries), .DS_Store, a notebook's .ipynb_checkpoints;
    - `classes` (folder_classes of the training folder) numbers the labels, so that a test folder that lacks a
      class (none of its images yet) shifts no other; a class folder not in it, or one that holds no image,
      is refused in one line naming it;
    - each image is read as it looks: turned by its EXIF orientation, 16-bit ones scaled to 8 bits (PIL's
      convert would clip them white), then converted to `mode`: "RGB" (3 channels) or "L" (1)."""

    def __init__(self, root: str, classes: list | None = None, mode: str = "RGB"):
        self.given_classes, self.hidden = classes, []
        super().__init__(root, transform=pil_to_tensor, loader=functools.partial(read_image, mode=mode),
                         is_valid_file=self.is_visible_image, allow_empty=True)
        counts = torch.bincount(torch.as_tensor(self.targets, dtype=torch.int64), minlength=len(self.classes))
        root = self.root  # as torchvision expanded it (~)
        empty = [c for c, n in zip(self.classes, counts.tolist())
                 if n == 0 and os.path.isdir(os.path.join(root, c))]
        if empty:  # a class folder that exists holds images: else a wrong extension, or no permission to read it
            folder = os.path.join(root, empty[0])
            why = ("cannot be read (permission denied)" if not os.access(folder, os.R_OK | os.X_OK) else
                   f"holds no image file ({' '.join(IMG_EXTENSIONS)})")
            more = f", nor do {', '.join(empty[1:3])}{' ...' if len(empty) > 3 else ''}" if len(empty) > 1 else ""
            raise UserError(f"the class folder {folder} {why}{more}: give it its images, or remove it (a class with no "
                            f"test images needs no test folder)")
        if self.hidden:
            log(f"{root}: left out {len(self.hidden)} hidden files (names that start with '.', such as "
                f"{self.hidden[0]}: a Mac's ._ metadata, .DS_Store, .ipynb_checkpoints)")

    def find_classes(self, directory):
        found = folder_classes(directory)
        if self.given_classes is None:
            return found, {c: i for i, c in enumerate(found)}
        extra = [c for c in found if c not in self.given_classes]
        if extra:
            raise UserError(f"{directory} holds the class folder{'s' if len(extra) > 1 else ''} "
                            f"{', '.join(map(repr, extra[:3]))}, not among the training classes (a typo, a letter's "
                            f"case?): rename or remove {'them' if len(extra) > 1 else 'it'}")
        return list(self.given_classes), {c: i for i, c in enumerate(self.given_classes)}

    def is_visible_image(self, path: str) -> bool:
        relative = os.path.relpath(path, self.root)
        if any(part.startswith(".") for part in relative.split(os.sep)):
            self.hidden.append(relative)
            return False
        return has_file_allowed_extension(path, IMG_EXTENSIONS)

    def __getstate__(self):  # what the loader workers get: not the list of hidden files
        return {**self.__dict__, "hidden": []}


def read_image(path: str, mode: str = "RGB") -> Image.Image:
    """An image file as it looks: turned by its EXIF orientation (as stored if that is malformed); 16 bits per
    pixel scaled to 8 (PIL's convert would clip them to white), then converted to `mode`."""
    with open(path, "rb") as f:
        image = Image.open(f)
        try:
            image = ImageOps.exif_transpose(image)
        except Exception:  # noqa: BLE001 - a malformed EXIF block: the pixels are still good
            image.load()
        if image.mode.startswith("I;16") or (image.mode == "I" and image.getextrema()[1] > 255):
            image = Image.fromarray((np.asarray(image, dtype=np.int64) >> 8).clip(0, 255).astype(np.uint8))
        return image.convert(mode)


def load_split(dataset: str, data_dir: str, train: bool, size: int = 0) -> ImageData:
    """The train or test split of `dataset`, cut to its first `size` samples if size > 0."""
    if dataset == "synthetic":
        full = make_synthetic(size or (50_000 if train else 10_000), train)
    else:
        full = read_cifar100(data_dir, train)
    if size > len(full):
        split = "train" if train else "test"
        raise UserError(f"--{split}-size {size} exceeds the {len(full)} {split} samples of {dataset}")
    if size > 0:  # what the data state of themselves (classes, statistics) stays
        full = replace(full, images=full.images[:size].clone(), labels=full.labels[:size].clone())
    return full


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
        raise UserError(f"load_data returned training images of {' x '.join(map(str, shape))} but test images of "
                        f"{' x '.join(map(str, test_shape))} (channels x height x width): "
                        f"both splits must hold images of one shape")
    num_classes = stated_classes(train) or stated_classes(test) or count_classes(train, test)
    for split, name in ((train, "training"), (test, "test")):
        labels = split.labels if isinstance(split, ImageData) else getattr(split, "targets", None)
        if labels is None or not len(labels):
            continue
        low, high = int(torch.as_tensor(labels).min()), int(torch.as_tensor(labels).max())  # tensor ops: fast
        if not 0 <= low <= high < num_classes:
            raise UserError(f"load_data's {name} labels span [{low}, {high}], outside "
                            f"[0, {num_classes}) for {num_classes} classes: labels must be class indices 0, 1, ...")
    mean, std = getattr(train, "mean", None), getattr(train, "std", None)
    if mean is None or std is None:
        if not isinstance(train, ImageData):
            raise UserError(f"load_data's training {type(train).__name__} states no per-channel mean and std, and "
                            f"computing them would read all of it: set its .mean and .std (tuples of {shape[0]} "
                            f"fractions of 255) in load_data")
        mean, std = channel_stats(train.images)
    if len(mean) != shape[0] or len(std) != shape[0] or min(std) <= 0:
        raise UserError(f"load_data states mean {tuple(mean)} and std {tuple(std)}: each needs {shape[0]} values "
                        f"(one per channel), and std must be positive")
    return DataSpec(*shape, num_classes=int(num_classes), mean=tuple(map(float, mean)), std=tuple(map(float, std)),
                    classes=class_names(train))


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
    device = call_and_agree(data_device, cfg.loader, env.device, *splits.values())
    val_data = None
    if train and cfg.val_size:
        train_data, val_data = call_and_agree(hold_out, train_data, cfg.val_size)
    return CheckedData(train_data, test_data, spec, fingerprints, device, val_data)


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


class Share(Subset):
    """A share of a split load_data returned (hold_out): an unreadable sample in it is named by its index
    in that split, the one the user knows (BadSample)."""


def check_split(split, name: str) -> tuple:
    """(channels, height, width) of a split's images; UserError if it is not ImageData of uint8 images
    (N, C, H, W) and int64 labels (N,), or a Dataset of (uint8 C x H x W tensor, integer label)."""
    if isinstance(split, ImageData):
        images, labels = split.images, split.labels
        if images.dtype != torch.uint8 or images.dim() != 4 or labels.dtype != torch.int64 or labels.shape != (len(images),):
            raise UserError(f"load_data's {name} ImageData holds images {tuple(images.shape)} {images.dtype} and labels "
                            f"{tuple(labels.shape)} {labels.dtype}: it needs uint8 images (N, C, H, W) and int64 labels (N,)")
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
    if not (isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3) or not integer_label:
        got = f"{type(image).__name__} {tuple(getattr(image, 'shape', ()))} {getattr(image, 'dtype', '')}".strip()
        raise UserError(f"load_data's {name} {type(split).__name__} yields ({got}, {type(label).__name__}) as item {first}: "
                        f"it must yield (uint8 tensor C x H x W, integer label); for image files, "
                        f"ImageFolder(root, transform=torchvision.transforms.v2.PILToTensor())")
    return tuple(image.shape)


def first_readable(split, name: str, tries: int = 10) -> tuple:
    """The first sample of a Dataset that reads, and its index: the one its image shape is taken from (an
    unreadable one is the loader's to skip or stop on: BadSample). UserError if the first `tries` all fail."""
    for i in range(min(tries, len(split))):
        try:
            return split[i], i
        except Exception as e:  # noqa: BLE001 - any failure to read is said, with where it was raised
            error = bad_sample(split, i, name, describe_exception(e))
    raise UserError(f"load_data's {name} split: none of its first {min(tries, len(split))} samples reads; the last: "
                    f"{error.describe()}; {error.fix}")


def stated_classes(split) -> int | None:
    """The number of classes a split states: num_classes, or the length of its `classes` list."""
    if getattr(split, "num_classes", None):
        return split.num_classes
    names = class_names(split)
    return len(names) if names else None


def class_names(split) -> tuple | None:
    """The names a split gives its classes, index by index (`classes`, as torchvision's datasets have it), if any."""
    names = getattr(split, "classes", None)
    return tuple(map(str, names)) if isinstance(names, (list, tuple)) and len(names) else None


def check_same_classes(names, test, source: str) -> None:
    """UserError unless every class the test split names has the index it has in `names` (the training split's,
    or the checkpoint's): by its `class_to_idx` where it has one (a split numbered by hand), else by the order of
    its `classes`. ImageFolder numbers the class folders it finds, in sorted order: a test folder that lacks one,
    or spells one otherwise, gives every later class's images another class's label, and a good model a bad
    score, without a word. (A test split that lacks only the last classes shifts nothing.)"""
    mapping = getattr(test, "class_to_idx", None)
    test_index = ({str(c): i for c, i in mapping.items()} if isinstance(mapping, dict) and mapping else
                  {c: i for i, c in enumerate(class_names(test) or ())})
    index = {c: i for i, c in enumerate(names or ())}
    if not index or not test_index or all(index.get(c) == i for c, i in test_index.items()):
        return
    lacks, extra = [c for c in index if c not in test_index], [c for c in test_index if c not in index]

    def listed(classes):
        return ", ".join(map(repr, classes[:3])) + (f" and {len(classes) - 3} more" if len(classes) > 3 else "")
    found = [f"lacks {listed(lacks)}"] if lacks else []
    found += [f"has {listed(extra)}, which {source} lacks"] if extra else []
    what = " and ".join(found) if found else "numbers the same classes otherwise"
    fix = ("rename or remove the test split's class folders that training lacks" if extra and not lacks else
           "fix the folder names, or number the test split by the training classes: "
           "dataset_utils.image_folder(path, classes=...) (README, Adapt it)")
    raise UserError(f"the test split's classes are not {source}'s: it {what}, so its labels would name other classes "
                    f"(ImageFolder numbers the class folders it finds); {fix}")


def count_classes(train, test) -> int:
    """1 + the largest label of either split (a Dataset must list its labels as `targets`)."""
    highest = []
    for split in (train, test):
        labels = split.labels if isinstance(split, ImageData) else getattr(split, "targets", None)
        if labels is None:
            raise UserError(f"load_data's {type(split).__name__} states no number of classes: set its .num_classes "
                            f"(or .classes, or .targets, the list of its labels) in load_data")
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
    count = images.numel() // images.shape[1]
    mean = total.double() / count
    std = (squares.double() / count - mean ** 2).clamp_min(0).sqrt()
    std = torch.where(std > 0, std, 255.0)  # a constant channel: leave its scale alone
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())


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


# ----------------------------------------------------------------------------- augmentation and loaders

# The augmentation, in one place: zero-pad by an eighth of each side (at least 1 pixel; 4 for 32, as in the
# WRN paper), crop back to the image's size at an offset drawn from the hash, and mirror left-right on
# one bit of it. crop_flip (one image, the CPU workers) and crop_flip_batch (a batch, on the device)
# cut the same pixels for the same hash.

def crop_padding(height: int, width: int) -> tuple:
    """The random crop's zero padding (rows, columns) on each side for an image of this size."""
    return max(1, height // 8), max(1, width // 8)


def crop_params(h, pad: tuple):
    """Crop offsets x in 0..2*pad_x and y in 0..2*pad_y of the padded image, and flip (0/1), from a hash
    (int or tensor)."""
    pad_y, pad_x = pad
    return (h & 0xFFFF) % (2 * pad_x + 1), ((h >> 16) & 0xFFFF) % (2 * pad_y + 1), (h >> 32) & 1


def pad_images(images: torch.Tensor, pad: tuple) -> torch.Tensor:
    """Zero-pad the last two dims, once up front, so that a random crop is a slice or a gather."""
    pad_y, pad_x = pad
    return torch.nn.functional.pad(images, (pad_x, pad_x, pad_y, pad_y))


def crop_flip(padded: torch.Tensor, h: int, pad: tuple) -> torch.Tensor:
    """One padded image (C, H + 2 pad_y, W + 2 pad_x) -> its random (C, H, W) crop, maybe mirrored."""
    dx, dy, flip = crop_params(h, pad)
    height, width = padded.shape[-2] - 2 * pad[0], padded.shape[-1] - 2 * pad[1]
    img = padded[:, dy:dy + height, dx:dx + width]
    return img.flip(-1) if flip else img


def crop_flip_batch(padded: torch.Tensor, idx: torch.Tensor, h: torch.Tensor, pad: tuple) -> torch.Tensor:
    """crop_flip for a batch, as tensor ops on the device: gather the images `idx` of the padded
    (N, C, H + 2 pad_y, W + 2 pad_x) uint8 tensor, then their rows and (possibly mirrored) columns."""
    dx, dy, flip = crop_params(h, pad)
    height, width = padded.shape[-2] - 2 * pad[0], padded.shape[-1] - 2 * pad[1]
    across = torch.arange(width, device=padded.device)
    rows = dy[:, None] + torch.arange(height, device=padded.device)
    cols = dx[:, None] + torch.where(flip[:, None].bool(), width - 1 - across, across)
    x = padded[idx]
    b, c = x.shape[:2]
    x = x.gather(2, rows[:, None, :, None].expand(b, c, height, x.shape[3]))
    return x.gather(3, cols[:, None, None, :].expand(b, c, height, width))


class ImageDataset(Dataset):
    """A split for the DataLoader: ImageData (held in memory), or a Dataset of (uint8 C x H x W tensor,
    label) whose items the loader's workers read; a sample that does not read as one of the split's shape
    comes as a BadSample. With `augment`, items are keyed (epoch, index) and get crop_flip with
    hash(seed, epoch, index); with `extra` (transforms.Augment), items carry that hash, and _collate applies
    `extra` to the batch: the same for any number of ranks or workers. `split`: "training" or "test"."""

    def __init__(self, data, augment: bool = False, seed: int = 0, split: str = "training", extra=None):
        self.data, self.augment, self.seed, self.split, self.extra = data, augment, seed, split, extra
        self.in_memory = isinstance(data, ImageData)
        self.image_shape = (tuple(data.images.shape[1:]) if self.in_memory else
                            tuple(first_readable(data, split)[0][0].shape))
        self.pad = crop_padding(*self.image_shape[1:])
        if self.in_memory:  # padded once, up front
            self.images = pad_images(data.images, self.pad) if augment else data.images

    def __len__(self):
        return len(self.data)

    def __getitem__(self, key):
        epoch, idx = key if self.augment else (None, key)
        if self.in_memory:
            image, label = self.images[idx], self.data.labels[idx]
        else:
            item = read_sample(self.data, idx, self.split, self.image_shape)
            if isinstance(item, BadSample):
                return item
            image, label = item
            image, label = pad_images(image, self.pad) if self.augment else image, int(label)  # int64 once collated
        if not self.augment:
            return image, label
        h = mix64(self.seed, epoch, idx)
        image = crop_flip(image, h, self.pad)
        if self.extra is not None and self.extra.active:  # transforms.Augment comes in the collate, on the batch
            return image, label, _signed(h)
        return image, label


@dataclass(frozen=True)
class BadSample:
    """A sample the loader could not take: its split, index, file (where the Dataset knows it) and why, and the
    way out; `slot`: its place in the rank's batch. The loader passes it on in place of the sample, and the
    ranks agree on it at their next check (train_utils.check_unreadable): skipped, or the run stops."""
    split: str
    index: int
    file: str | None
    reason: str
    fix: str = "fix or remove the file"
    slot: int = -1

    def describe(self) -> str:
        split, notes = self.split, [self.file] if self.file else []
        if split == "validation":  # a training sample that --val-size held out
            split, notes = "training", notes + ["held out for validation"]
        where = f" ({', '.join(notes)})" if notes else ""
        return f"{split} sample {self.index}{where}: {self.reason}"


def bad_sample(data, idx: int, split: str, reason: str, **fix) -> BadSample:
    """The BadSample for sample `idx` of `data`: named by its index in load_data's split and by its file."""
    index = idx
    while isinstance(data, Share):
        data, index = data.dataset, data.indices[index]
    file = sample_file(data, index)
    if file and os.path.basename(file).startswith("._") and not fix:  # a folder unpacked from a Mac's tar
        fix = {"fix": f"it is a Mac's AppleDouble metadata file, not an image: delete them (find "
                      f"{getattr(data, 'root', 'DIR')} -name '._*' -delete), or read the folder with "
                      f"dataset_utils.image_folder, which leaves out names that start with '.'"}
    elif file and os.path.islink(file) and not os.path.exists(file) and not fix:
        fix = {"fix": f"it is a symbolic link to {os.readlink(file)}, which does not exist: restore that file, or "
                      f"remove the link"}
    return BadSample(split, index, file, reason, **fix)


def read_sample(data, idx: int, split: str, shape: tuple | None = None):
    """data[idx] as (uint8 image, label) of `shape` (C, H, W) if given, or a BadSample saying why not: any
    exception in reading it (a corrupt, empty or missing file; named with where it was raised), or an image
    of another shape or type."""
    try:
        image, label = data[idx]
    except Exception as e:  # noqa: BLE001 - said in one line, with where it was raised
        return bad_sample(data, idx, split, describe_exception(e))
    if shape is not None and not (isinstance(image, torch.Tensor) and image.dtype == torch.uint8
                                  and tuple(image.shape) == shape):
        got = (" x ".join(map(str, image.shape)) + f" {str(image.dtype).removeprefix('torch.')}"
               if isinstance(image, torch.Tensor) else type(image).__name__)
        want = " x ".join(map(str, shape))
        return bad_sample(data, idx, split, f"an image of {got}, not {want} uint8 like the first",
                          fix=f"make every image {want} in load_data (e.g. transform=v2.Compose([v2.PILToTensor(), "
                              f"v2.Resize(({shape[1]}, {shape[2]}))]))")
    return image, label


def sample_file(data, idx: int) -> str | None:
    """The file behind sample `idx`, where the Dataset lists its files (ImageFolder's `samples`), through
    any Subset; else None."""
    while isinstance(data, Subset):
        data, idx = data.dataset, data.indices[idx]
    samples = getattr(data, "samples", None) or getattr(data, "imgs", None)
    if isinstance(samples, (list, tuple)) and 0 <= idx < len(samples):
        entry = samples[idx]
        return str(entry[0] if isinstance(entry, (tuple, list)) else entry)
    return None


def describe_exception(e: Exception) -> str:
    """`Type: first line of the message (at file.py:line)`, the line where it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    message = re.sub(r" ?<_io\.\w+ name='[^']*'>", "", str(e).splitlines()[0])[:200] if str(e) else ""  # PIL: the path again
    return f"{type(e).__name__}: {message}{where}" if message else f"{type(e).__name__}{where}"


class EpochSampler:
    """Which samples each rank trains on at each step: a batch sampler of (epoch, index) keys.

    The epoch's order is randperm(seed + epoch), as in DistributedSampler. Global step s covers
    positions [s * batch, (s + 1) * batch) of that order, whatever the world size, so
    `set_epoch(epoch, start=p)` resumes at position p with exactly the samples the epoch has not
    yet seen, even on another number of ranks or with another batch size.

    Within a step the positions are dealt, like DistributedSampler's shards, to V = world_size x
    accum_steps virtual ranks (`deal_step`): rank r's k-th accumulation micro-step is virtual rank
    r + k x world_size, so W ranks x A micro-steps train on exactly the micro-batches that W x A
    ranks would. Each step yields rank r's A micro-batches back to back, and `step_split` tells the
    training step where they part. Nothing is padded or dropped: the epoch's last, short step deals
    what is left the same way, so some micro-batches there are one sample smaller, or empty, and
    every rank still takes the same number of steps."""

    def __init__(self, num_samples: int, *, batch_size: int, rank: int, world_size: int, accum_steps: int = 1,
                 seed: int = 0):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size, self.accum_steps = rank, world_size, accum_steps
        assert batch_size % (world_size * accum_steps) == 0, "the global batch splits into equal micro-batches"
        self.epoch, self.start, self.skipped = 0, 0, []

    def set_epoch(self, epoch: int, start: int = 0, skipped: list | None = None) -> None:
        """Sample `epoch`'s order from position `start`. `skipped`: the epoch's unreadable samples skipped so
        far (Progress.skipped), a list the loader adds to (AgreedLoader)."""
        self.epoch, self.start, self.skipped = epoch, start, skipped if skipped is not None else []

    def step_split(self, position: int, skipped=()) -> tuple:
        """The global step that starts at `position` of the epoch's order: its number of samples (the
        epoch's last step may be short) and the sizes of this rank's micro-batches in it, less the
        `skipped` BadSamples (each at its slot in the rank's batch)."""
        step_samples = min(self.batch_size, self.num_samples - position)
        sizes = [len(r) for r in deal_step(step_samples, self.rank, self.world_size, self.accum_steps)]
        ends = [sum(sizes[:k + 1]) for k in range(len(sizes))]
        for bad in skipped:
            sizes[next(k for k, end in enumerate(ends) if bad.slot < end)] -= 1
        return step_samples, sizes

    def __iter__(self):
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        for first in range(self.start, self.num_samples, self.batch_size):
            step = order[first:first + self.batch_size]
            yield [(self.epoch, step[i]) for micro in deal_step(len(step), self.rank, self.world_size, self.accum_steps)
                   for i in micro]

    def __len__(self) -> int:
        return -(-max(self.num_samples - self.start, 0) // self.batch_size)


def deal_step(step_samples: int, rank: int, world_size: int, accum_steps: int) -> list:
    """The positions within a global step of `step_samples` samples that rank `rank`'s micro-steps take,
    one range per micro-step: virtual rank v = rank + k x world_size takes every V-th position from v,
    V = world_size x accum_steps. The one place the split is made: the sampler deals by it, and the
    training step splits its batch by it (EpochSampler.step_split)."""
    v = world_size * accum_steps
    return [range(rank + k * world_size, step_samples, v) for k in range(accum_steps)]


def data_device(loader: str, device: torch.device, *splits):
    """Where the loaders keep the data: `device` (--loader gpu, and auto on CUDA) for ImageData held in
    memory, or None for DataLoaders with CPU workers (--loader torch, and any Dataset)."""
    in_memory = all(isinstance(s, ImageData) for s in splits)  # a Dataset is read by the workers
    if loader == "gpu" and not in_memory:
        other = next(type(s).__name__ for s in splits if not isinstance(s, ImageData))
        raise UserError(f"--loader gpu needs the data in memory (dataset_utils.ImageData), but load_data returned "
                        f"a {other}: use --loader torch (or auto)")
    return device if in_memory and (loader == "gpu" or (loader == "auto" and device.type == "cuda")) else None


def _collate(shape, batch, extra=None):
    """(images, labels, unreadable): default_collate of the samples that read, empty tensors if none did (or a
    rank has nothing left in the last step), and the BadSamples in their slots. Items that carry their hash
    (ImageDataset with `extra`) get `extra` (transforms.Augment) here, batched: the same bits as one by one."""
    unreadable = [replace(b, slot=i) for i, b in enumerate(batch) if isinstance(b, BadSample)]
    good = [b for b in batch if not isinstance(b, BadSample)]
    if not good:
        return torch.empty(0, *shape, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), unreadable
    if len(good[0]) == 3:
        images, labels, hashes = default_collate(good)
        return extra(images, hashes), labels, unreadable
    return (*default_collate(good), unreadable)


def build_loaders(train, test, *, batch_size: int, rank: int, world_size: int, accum_steps: int, eval_batch: int,
                  seed: int, workers: int, pin_memory: bool, device=None, skip_bad_samples: int = 0, val=None,
                  augment: dict | None = None, spec=None):
    """The training loader (this rank's share of each global batch of `batch_size`, as `accum_steps`
    micro-batches back to back; call batch_sampler.set_epoch each epoch, and step_split for each batch's
    micro-batches) and the test loader (sharded without padding or dropping: every test image is scored
    exactly once, in batches of `eval_batch`). The splits are ImageData or Datasets (measure_data); train
    may be None (no training loader). With `device`, both are DeviceLoaders over ImageData held on that
    device; else DataLoaders whose workers read the samples, in AgreedLoaders that skip up to
    `skip_bad_samples` unreadable training samples per epoch (none in the test set). `augment` (the flags
    auto_augment, random_erase, mixup_alpha, cutmix_alpha; `spec`: the data's DataSpec) adds transforms.Augment
    per sample and transforms.Mix per micro-batch to the training loader. With a `val` split (--val-size), the
    loaders are (train, test, val), val sharded as the test set is."""
    test_loader = build_test_loader(test, rank=rank, world_size=world_size, batch_size=eval_batch, workers=workers,
                                    pin_memory=pin_memory, device=device)
    loaders = [test_loader] if val is None else [test_loader, build_test_loader(
        val, rank=rank, world_size=world_size, batch_size=eval_batch, workers=workers, pin_memory=pin_memory,
        device=device, split="validation")]
    if train is None:  # --evaluate
        return None, *loaders
    sampler = EpochSampler(len(train), batch_size=batch_size, rank=rank, world_size=world_size,
                           accum_steps=accum_steps, seed=seed)
    augment = augment or {}
    image_shape = (spec.channels, spec.height, spec.width) if spec else None
    extra = (Augment(image_shape, auto_augment=augment.get("auto_augment"),
                     random_erase=augment.get("random_erase", 0.0), fill=tuple(round(255 * m) for m in spec.mean))
             if spec and augment else None)
    mix = Mix(mixup_alpha=augment.get("mixup_alpha", 0.0), cutmix_alpha=augment.get("cutmix_alpha", 0.0),
              num_classes=spec.num_classes if spec else 0, seed=seed, rank=rank, world_size=world_size)
    if device is not None:
        return DeviceLoader(train, device, sampler=sampler, seed=seed, extra=extra, mix=mix), *loaders
    # A private generator: a DataLoader otherwise draws its workers' seeds from the global RNG when
    # it starts an epoch, which would make dropout depend on whether the run was resumed.
    dataset = ImageDataset(train, augment=True, seed=seed, extra=extra)
    collate = functools.partial(_collate, dataset.image_shape, extra=extra)
    train_loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                              **_loader_options(workers, pin_memory, seed))
    return AgreedLoader(train_loader, limit=skip_bad_samples, mix=mix), *loaders


def build_test_loader(test, *, rank: int, world_size: int, batch_size: int, workers: int, pin_memory: bool,
                      device=None, split: str = "test"):
    """Rank r scores test images r, r + world_size, ...: no padding, no dropping, maybe none at all."""
    shard = range(rank, len(test), world_size)
    if device is not None:
        return DeviceLoader(test, device, indices=shard, batch_size=batch_size)
    dataset = ImageDataset(test, split=split)
    return AgreedLoader(DataLoader(dataset, batch_size=batch_size, sampler=shard, **_loader_options(workers, pin_memory),
                                   collate_fn=functools.partial(_collate, dataset.image_shape)))


def _loader_options(workers: int, pin_memory: bool, seed: int = 0) -> dict:
    """Both loaders' options. Their workers start after the process group, when the process runs other threads
    (gloo's or NCCL's, the other loader's queue feeders): a fork then can hang the child in the fork itself (seen
    in about one two-rank run in 30 for the test loader, and once in a CI run for the training loader), so they
    are spawned, once per run (they persist), not forked; a Dataset must then be defined at a module's top level."""
    return dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
                generator=torch.Generator().manual_seed(seed), worker_init_fn=deaf_to_stop_signals if workers else None,
                multiprocessing_context="spawn" if workers else None)


class AgreedLoader:
    """A DataLoader over ImageDataset, whose batches lack the samples that did not read (BadSample): it yields
    (images, labels) of the rest, and step_split(position) gives the micro-batches' sizes without them. The
    ranks agree on the unreadable samples (check_unreadable: a small all-reduce) when the training loop
    calls check() (at its stop checks, before any checkpoint) and after the last batch: each is named in the
    log and skipped, up to `limit` per epoch; past it, or for any test sample, every rank raises UserError."""

    def __init__(self, loader: DataLoader, limit: int = 0, mix=None):
        self.loader, self.limit, self.mix = loader, limit, mix
        self.batch_sampler = loader.batch_sampler if isinstance(loader.batch_sampler, EpochSampler) else None
        self.found, self.gaps = [], []  # unreadable since the last check; the last batch's

    def __len__(self):
        return len(self.loader)

    def step_split(self, position: int) -> tuple:
        return self.batch_sampler.step_split(position, skipped=self.gaps)

    def __iter__(self):
        try:
            with stop_signals_held():  # a stop signal sent to every process reaches the rank alone (signals.py)
                batches = iter(self.loader)  # starts the workers (once: they persist), which get the Dataset pickled
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            if "pickle" not in str(e):
                raise
            raise UserError(f"load_data's {type(self.loader.dataset.data).__name__} cannot be sent to the DataLoader "
                            f"workers ({str(e).splitlines()[0]}): define its class at the top level of a module, not "
                            f"inside a function, or use --workers 0") from None
        for step, (images, labels, unreadable) in enumerate(batches):
            self.gaps = unreadable
            self.found += unreadable
            if self.mix is not None and self.mix.active:
                images, labels = mix_step(self, step, images, labels)
            yield images, labels
        self.check()

    def check(self) -> None:
        """The ranks agree on the samples found unreadable since the last check: a collective."""
        skipped = self.batch_sampler.skipped if self.batch_sampler else []
        check_unreadable(self.found, skipped=skipped, limit=self.limit if self.batch_sampler else 0)


def check_unreadable(found: list, *, skipped: list, limit: int) -> None:
    """The ranks agree on the unreadable samples (BadSample) each `found` since the last check: one small
    all-reduce, and the samples gathered only if there are any. Each is named in the log and its description
    added to `skipped` (the epoch's so far), up to `limit` in all; past it, or for any test sample (the test
    set is scored whole), every rank raises UserError naming it and the way out. Empties `found`."""
    if dist.is_initialized():
        nccl = dist.get_backend() == "nccl"  # NCCL reduces only CUDA tensors: on this rank's GPU (set_device)
        count = torch.tensor([len(found)], device=torch.cuda.current_device() if nccl else "cpu")
        dist.all_reduce(count)
    else:
        count = torch.tensor([len(found)])
    if not count.item():
        return
    new = sorted((bad for mine in all_gather(list(found)) for bad in mine), key=lambda bad: (bad.split, bad.index))
    found.clear()
    first = new[0]
    if first.split != "training":
        raise UserError(f"{first.describe()}; {first.fix} (the {first.split} set is scored whole: --skip-bad-samples "
                        f"skips the samples trained on only)")
    if not limit:
        raise UserError(f"{first.describe()}; {first.fix}, or skip such samples with --skip-bad-samples N")
    over = len(skipped) + len(new) > limit
    for bad in new:  # each named, those past the limit too
        skipped.append(bad.describe())
        log(f"warning: {'unreadable' if over else 'skipped'} {bad.describe()} ({len(skipped)} of at most {limit} "
            f"this epoch)")
    if over:
        raise UserError(f"more than {limit} unreadable training samples this epoch (--skip-bad-samples {limit}; the "
                        f"log names them), the latest {new[-1].describe()}; {new[-1].fix}, or raise --skip-bad-samples")


class DeviceLoader:
    """The whole split lives on the device as uint8 (CIFAR-100 is 184 MB), and each batch is
    gathered and augmented there with tensor ops: no CPU workers, no host-to-device copies.
    Batches hold the same samples as the torch loader's (the same EpochSampler) with the same
    crops and flips (the same hash). For data that does not fit on the device, use --loader torch."""

    def __init__(self, data: ImageData, device, sampler=None, indices=None, batch_size: int = 0, seed: int = 0,
                 extra=None, mix=None):
        self.sampler, self.batch_size, self.seed, self.extra, self.mix = sampler, batch_size, seed, extra, mix
        self.batch_sampler = sampler  # as DataLoader names it
        augment = sampler is not None
        self.pad = crop_padding(*data.images.shape[-2:])
        images = pad_images(data.images, self.pad) if augment else data.images
        self.images, self.labels = images.to(device), data.labels.to(device)
        self.indices = None if indices is None else torch.as_tensor(list(indices), dtype=torch.int64, device=device)

    def __len__(self):
        return len(self.sampler) if self.sampler is not None else -(-len(self.indices) // self.batch_size)

    def step_split(self, position: int) -> tuple:
        return self.sampler.step_split(position)

    def check(self) -> None:
        """Nothing to agree on: data held in memory all read (AgreedLoader.check's counterpart)."""

    def __iter__(self):
        if self.sampler is None:
            for idx in self.indices.split(self.batch_size):
                yield self.images[idx], self.labels[idx]
            return
        # The epoch's whole order goes to the device at once: one copy, not one per step.
        steps = list(self.sampler)
        order = torch.tensor([i for keys in steps for _, i in keys], dtype=torch.int64).to(self.images.device)
        h = mix64(self.seed, self.sampler.epoch, order)
        sizes = [len(keys) for keys in steps]
        for step, (idx, hs) in enumerate(zip(order.split(sizes), h.split(sizes))):
            images, labels = crop_flip_batch(self.images, idx, hs, self.pad), self.labels[idx]
            if self.extra is not None:  # TrivialAugment, random erasing: the same hash, batched
                images = self.extra(images, hs)
            if self.mix is not None and self.mix.active:
                images, labels = mix_step(self, step, images, labels)
            yield images, labels


def mix_step(loader, step: int, images: torch.Tensor, labels: torch.Tensor) -> tuple:
    """The training loader's (AgreedLoader's or DeviceLoader's) `step`-th batch of this pass through its
    transforms.Mix: mixup/cutmix within each micro-batch (step_split's, unread samples left out), soft targets."""
    sampler = loader.batch_sampler
    position = sampler.start + step * sampler.batch_size  # where the step starts in the epoch's order
    _, micro_sizes = loader.step_split(position)
    return loader.mix(images, labels, epoch=sampler.epoch, position=position, micro_sizes=micro_sizes)


class Normalize(torch.nn.Module):
    """uint8 batch on the device -> normalised float, in the memory format the model wants."""

    def __init__(self, mean, std, device, channels_last: bool = False):
        super().__init__()
        std = torch.tensor(std, device=device).view(1, -1, 1, 1)  # one value per channel
        self.scale = 1.0 / (255.0 * std)
        self.shift = torch.tensor(mean, device=device).view(1, -1, 1, 1) / std
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().mul_(self.scale).sub_(self.shift)
        return x.contiguous(memory_format=self.memory_format)
