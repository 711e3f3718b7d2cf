"""Image files as users have them, root/<class>/<image>: torchvision's ImageFolder with hidden files left out,
the classes numbered alike in both splits, and each image read as it looks (EXIF orientation, 16-bit). The
reader an adapter calls is dataset_utils.image_folder, which imports this (and torchvision) when called."""
import functools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageOps
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
from torchvision.transforms.functional import pil_to_tensor

from machinery.data_checks import mean_std_of_sums
from machinery.errors import UserError, call_and_agree
from machinery.output import log


def call_once_and_share(fn, *args, folder):
    """fn(*args) on rank 0 alone, its result sent to every rank (pickled; a UserError raised on all, as
    call_and_agree's): for work each rank would otherwise repeat on shared storage, such as listing a folder. Every
    rank must ask for the same `folder`: one that asks for another (a folder per rank) is refused, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn(*args)
    box = [(str(folder), call_and_agree(fn, *args, here=dist.get_rank() == 0))]
    dist.broadcast_object_list(box, src=0)  # NCCL: through this rank's GPU (set_device)
    rank_0s, result = box[0]
    call_and_agree(check_same_folder, str(folder), rank_0s)
    return result


def check_same_folder(folder: str, rank_0s: str) -> None:
    if folder != rank_0s:
        raise UserError(f"rank {dist.get_rank()} reads the image folder {folder}, rank 0 {rank_0s}: a folder is "
                        f"listed once, by rank 0, for every rank; give every rank the same folder (the sampler "
                        f"already gives each rank its share of it)")


def folder_classes(root) -> list:
    """The classes of an image folder root/<class>/<image>: its subfolders' names, sorted, less those starting with
    "." (.ipynb_checkpoints). Give them to image_folder for both splits, so that labels mean the same. Read by rank 0
    alone, as the files are (ImageFolderSplit.make_dataset)."""
    return call_once_and_share(list_classes, root, folder=root)


def list_classes(root) -> list:
    try:
        names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError as e:
        raise UserError(f"cannot read the image folder {root} ({e.strerror}): --data-dir must hold train/ "
                        f"and test/, each with one folder of images per class") from None
    if not names:
        raise UserError(f"the image folder {root} holds no class folders: it needs one folder of images per "
                        f"class, {root}/<class>/<image>")
    return names


class ImageFolderSplit(ImageFolder):
    """torchvision's ImageFolder, yielding (uint8 C x H x W tensor, label), for folders as users have them:
    - names that start with "." are left out, said in one line: a Mac's ._ files (AppleDouble metadata beside
      each file, which a tar or copy made on a Mac carries), .DS_Store, a notebook's .ipynb_checkpoints;
    - `classes` (folder_classes of the training folder) numbers the labels, so that a test folder that lacks a
      class (none of its images yet) shifts no other; a class folder not in it, or one that holds no image,
      is refused in one line naming it;
    - each image is read as it looks: turned by its EXIF orientation, 16-bit ones scaled to 8 bits (PIL's
      convert would clip them white), then converted to `mode`: "RGB" (3 channels) or "L" (1), and resized to
      `size` if given;
    - `samples` (--train-size, --test-size) keeps that many images, spread evenly over the sorted list (every class
      in its share; the first N would be the first classes alone), the same in every run (0: all)."""

    def __init__(self, root: str, classes: list | None = None, mode: str = "RGB", size=None, samples: int = 0):
        self.given_classes, self.hidden = classes, []
        size = (size, size) if isinstance(size, int) else size
        self.resize_to = size  # (height, width) every image is resized to, or None
        read = functools.partial(read_image, mode=mode, size=size)
        super().__init__(root, transform=pil_to_tensor, loader=read,
                         is_valid_file=self.is_visible_image, allow_empty=True)
        counts = torch.bincount(torch.as_tensor(self.targets, dtype=torch.int64), minlength=len(self.classes))
        root = self.root  # as torchvision expanded it (~)
        empty = [c for c, n in zip(self.classes, counts.tolist())
                 if n == 0 and os.path.isdir(os.path.join(root, c))]
        # a class folder that exists holds images: else a wrong extension, or no permission to read it
        if empty:
            folder = os.path.join(root, empty[0])
            why = ("cannot be read (permission denied)" if not os.access(folder, os.R_OK | os.X_OK) else
                   f"holds no image file ({' '.join(IMG_EXTENSIONS)})")
            more = (f", nor do {', '.join(empty[1:3])}{' ...' if len(empty) > 3 else ''}" if len(empty) > 1
                    else "")
            raise UserError(f"the class folder {folder} {why}{more}: give it its images, or remove it (a "
                            f"class with no test images needs no test folder)")
        if samples:
            self.keep_spread(samples)
        if self.hidden:
            log(f"{root}: left out {len(self.hidden)} hidden files (names that start with '.', such as "
                f"{self.hidden[0]}: a Mac's ._ metadata, .DS_Store, .ipynb_checkpoints)")

    def keep_spread(self, samples: int) -> None:
        """Keep `samples` of the images, spread evenly over the list (as mean_std picks them)."""
        n = len(self.samples)
        if samples > n:
            raise UserError(f"{self.root} holds {n} images, fewer than the {samples} asked for (--train-size or "
                            f"--test-size): ask for at most {n}, or 0 for all")
        self.samples = [self.samples[i * n // samples] for i in range(samples)]
        self.imgs, self.targets = self.samples, [label for _, label in self.samples]

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        """The (file, label) list: made by rank 0 alone and sent to the other ranks, so that a job lists the
        folder once, not once per rank (on a parallel file system each listing loads its metadata server)."""
        def list_files():
            start = time.perf_counter()
            samples = ImageFolder.make_dataset(directory, class_to_idx, extensions=extensions,
                                               is_valid_file=is_valid_file, allow_empty=allow_empty)
            return samples, self.hidden, time.perf_counter() - start

        samples, self.hidden, seconds = call_once_and_share(list_files, folder=directory)
        if dist.is_initialized() and dist.get_world_size() > 1:
            log(f"{directory}: {len(samples)} files listed in {seconds:.1f} s by rank 0, for all "
                f"{dist.get_world_size()} ranks")
        return samples

    def find_classes(self, directory):
        found = folder_classes(directory)
        if self.given_classes is None:
            return found, {c: i for i, c in enumerate(found)}
        extra = [c for c in found if c not in self.given_classes]
        if extra:
            raise UserError(f"{directory} holds the class folder{'s' if len(extra) > 1 else ''} "
                            f"{', '.join(map(repr, extra[:3]))}, not among the training classes (a typo, a "
                            f"letter's case?): rename or remove {'them' if len(extra) > 1 else 'it'}")
        return list(self.given_classes), {c: i for i, c in enumerate(self.given_classes)}

    def is_visible_image(self, path: str) -> bool:
        relative = os.path.relpath(path, self.root)
        if any(part.startswith(".") for part in relative.split(os.sep)):
            self.hidden.append(relative)
            return False
        return has_file_allowed_extension(path, IMG_EXTENSIONS)

    def __getstate__(self):  # what the loader workers get: not the list of hidden files
        return {**self.__dict__, "hidden": []}


def read_image(path: str, mode: str = "RGB", size: tuple | None = None) -> Image.Image:
    """An image file as it looks: turned by its EXIF orientation (as stored if that is malformed); 16 bits per
    pixel scaled to 8 (PIL's convert would clip them to white), then converted to `mode`, and resized to
    `size` (height, width) if given and other."""
    with open(path, "rb") as f:
        image = Image.open(f)
        try:
            image = ImageOps.exif_transpose(image)
        except Exception:  # noqa: BLE001 - a malformed EXIF block: the pixels are still good
            image.load()
        if image.mode.startswith("I;16") or (image.mode == "I" and image.getextrema()[1] > 255):
            image = Image.fromarray((np.asarray(image, dtype=np.int64) >> 8).clip(0, 255).astype(np.uint8))
        image = image.convert(mode)
        if size is not None and image.size != (size[1], size[0]):  # PIL's size is (width, height)
            image = image.resize((size[1], size[0]), Image.Resampling.BILINEAR)
        return image


def mean_std(split, samples: int = 2000) -> tuple:
    """Per-channel mean and std (fractions of 255) of a Dataset of (uint8 C x H x W tensor, label), from exact integer
    sums over `samples` images spread evenly (0: all); unreadable ones skipped. Read by rank 0 alone, sent to all.
    The sizes of the images read are kept as split.image_sizes (ImageSizes), for the Data line."""
    mean, std, sizes = call_once_and_share(measure_mean_std, split, samples,
                                           folder=getattr(split, "root", "the split"))
    try:
        split.image_sizes = sizes
    except AttributeError:  # a Dataset that takes no attributes: the Data line gives the first image's size
        pass
    return mean, std


@dataclass(frozen=True)
class ImageSizes:
    """The heights and widths of the images mean_std read: `read` of the split's `total`."""
    heights: tuple
    widths: tuple
    read: int
    total: int

    def describe(self, channels: int) -> str:
        """`1 x 12..16 x 12..16`, and of how many images where not all were read."""
        def span(low, high):
            return f"{low}" if low == high else f"{low}..{high}"
        seen = "" if self.read == self.total else f" (in the {self.read} of {self.total} read)"
        return f"{channels} x {span(*self.heights)} x {span(*self.widths)}{seen}"


def measure_mean_std(split, samples: int) -> tuple:
    n = len(split)
    picked = range(n) if not samples or samples >= n else [i * n // samples for i in range(samples)]
    total = squares = count = 0
    heights, widths = [], []
    for i in picked:
        try:
            x = split[i][0].to(torch.int64)
        except Exception:  # noqa: BLE001 - the loader names unreadable samples when it meets them
            continue
        total, squares, count = (total + x.sum(dim=(1, 2)), squares + (x * x).sum(dim=(1, 2)),
                                 count + x[0].numel())
        heights.append(x.shape[1])
        widths.append(x.shape[2])
    if not count:
        raise UserError(f"none of the {len(picked)} samples of {getattr(split, 'root', 'the split')} read: "
                        f"cannot compute their mean and std")
    sizes = ImageSizes((min(heights), max(heights)), (min(widths), max(widths)), len(heights), n)
    return (*mean_std_of_sums(total, squares, count), sizes)
