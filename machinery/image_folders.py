"""Image folders, root/<class>/<image>: hidden files left out, images read as they look."""
import contextlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageOps
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
from torchvision.transforms.functional import pil_to_tensor

from machinery.data_checks import mean_std_of_sums
from machinery.errors import UserError, agree_on_error, call_and_agree
from machinery.output import log


def call_once_and_share(fn, folder):
    """fn() on rank 0, its result (or UserError) sent to all: `folder` is listed once."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    box = [(str(folder), call_and_agree(fn, here=dist.get_rank() == 0))]
    dist.broadcast_object_list(box, src=0)  # NCCL: through this rank's GPU (set_device)
    rank_0s, result = box[0]
    agree_on_error(None if str(folder) == rank_0s else UserError(
        f"rank {dist.get_rank()} reads the image folder {folder}, rank 0 {rank_0s}: a folder is listed once, by rank "
        f"0, for every rank; give every rank the same folder (the sampler gives each its share)"))
    return result


def folder_classes(root) -> list:
    """root/<class>/<image>'s classes: its subfolders not starting with ".", sorted."""
    def list_classes():
        try:
            names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        except OSError as e:
            raise UserError(f"cannot read the image folder {root} ({e.strerror}): --data-dir must hold train/ "
                            f"and test/ of class folders") from None
        if not names:
            raise UserError(f"the image folder {root} holds no class folders: it needs {root}/<class>/<image>")
        return names
    return call_once_and_share(list_classes, root)


class ImageFolderSplit(ImageFolder):
    """ImageFolder of (uint8 tensor, label), numbered by `classes`; `samples`: N spread evenly."""

    def __init__(self, root: str, classes: list | None = None, mode: str = "RGB", size=None, samples: int = 0):
        self.given_classes, self.hidden, self.mode = classes, [], mode
        self.resize_to = (size, size) if isinstance(size, int) else size  # (height, width), or None
        super().__init__(root, transform=pil_to_tensor, loader=self.read_image,
                         is_valid_file=self.is_visible_image, allow_empty=True)
        root = self.root  # as torchvision expanded it (~)
        held = set(self.targets)
        empty = [c for i, c in enumerate(self.classes) if i not in held and os.path.isdir(os.path.join(root, c))]
        if empty:  # a wrong extension, or no permission to read it
            folder = os.path.join(root, empty[0])
            why = ("cannot be read (permission denied)" if not os.access(folder, os.R_OK | os.X_OK) else
                   f"holds no image file ({' '.join(IMG_EXTENSIONS)})")
            raise UserError(f"the class folder {folder} {why}: give it its images, or remove it")
        n = len(self.samples)
        if samples > n:
            raise UserError(f"{root} holds {n} images, fewer than the {samples} asked (--train-size or --test-size)")
        if samples:
            self.samples = [self.samples[i * n // samples] for i in range(samples)]
            self.imgs, self.targets = self.samples, [label for _, label in self.samples]
        if self.hidden:
            log(f"{root}: left out {len(self.hidden)} hidden files (names that start with '.', such as "
                f"{self.hidden[0]}: a Mac's ._ metadata, .DS_Store, .ipynb_checkpoints)")
        self.hidden = []  # not pickled for the loader workers

    def make_dataset(self, directory, class_to_idx, **options):
        """The (file, label) list, by rank 0 for all: a listing loads the metadata server."""
        start = time.perf_counter()  # rank 0's listing and broadcast
        samples, self.hidden = call_once_and_share(
            lambda: (ImageFolder.make_dataset(directory, class_to_idx, **options), self.hidden), directory)
        if dist.is_initialized() and dist.get_world_size() > 1:
            log(f"{directory}: {len(samples)} files listed in {time.perf_counter() - start:.1f} s by rank 0, for all "
                f"{dist.get_world_size()} ranks")
        return samples

    def find_classes(self, directory):
        found = folder_classes(directory)
        classes = found if self.given_classes is None else list(self.given_classes)
        extra = [c for c in found if c not in classes]
        if extra:
            raise UserError(f"{directory} holds the class folder(s) {', '.join(map(repr, extra[:3]))}, not among the "
                            f"training classes (a typo, a letter's case?): rename or remove them")
        return classes, {c: i for i, c in enumerate(classes)}

    def is_visible_image(self, path: str) -> bool:
        relative = os.path.relpath(path, self.root)
        if any(part.startswith(".") for part in relative.split(os.sep)):
            self.hidden.append(relative)
            return False
        return has_file_allowed_extension(path, IMG_EXTENSIONS)

    def read_image(self, path: str) -> Image.Image:
        """An image as it looks (EXIF-turned), in self.mode, of self.resize_to if set."""
        with open(path, "rb") as f:
            image = Image.open(f)
            try:
                image = ImageOps.exif_transpose(image)
            except Exception:  # noqa: BLE001 - a malformed EXIF block: the pixels are still good
                image.load()
            if image.mode.startswith("I;16") or (image.mode == "I" and image.getextrema()[1] > 255):
                # 16 bits scaled to 8: PIL's convert would clip them to white
                image = Image.fromarray((np.asarray(image, dtype=np.int64) >> 8).clip(0, 255).astype(np.uint8))
            image = image.convert(self.mode)
            if self.resize_to and image.size != (wh := tuple(self.resize_to[::-1])):  # PIL's size: (width, height)
                image = image.resize(wh, Image.Resampling.BILINEAR)
            return image


def mean_std(split, samples: int = 2000) -> tuple:
    """Exact per-channel mean and std / 255 of `samples` images (0: all); sizes in split.image_sizes."""
    def measure():
        n = len(split)
        picked = range(n) if not samples or samples >= n else [i * n // samples for i in range(samples)]
        total = squares = count = 0
        sizes = []
        for i in picked:
            try:
                x = split[i][0].to(torch.int64)
            except Exception:  # noqa: BLE001 - the loader names them
                continue
            total, squares, count = total + x.sum((1, 2)), squares + (x * x).sum((1, 2)), count + x[0].numel()
            sizes.append(tuple(x.shape[1:]))
        if not count:
            raise UserError(f"none of the {len(picked)} samples of {getattr(split, 'root', 'the split')} read")
        span = [f"{min(s)}" if min(s) == max(s) else f"{min(s)}..{max(s)}" for s in zip(*sizes)]
        seen = "" if len(sizes) == n else f" (in the {len(sizes)} of {n} read)"
        return (*mean_std_of_sums(total, squares, count), " x ".join(span) + seen)

    mean, std, sizes = call_once_and_share(measure, getattr(split, "root", "the split"))
    with contextlib.suppress(AttributeError):  # else the Data line gives the first's size
        split.image_sizes = sizes  # `12..16 x 12..17`: height x width
    return mean, std
