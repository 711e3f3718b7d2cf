"""CIFAR-100 (or synthetic data of its shape) as uint8 tensors, and the DDP data loaders.

The images stay uint8 until they reach the device: the loader workers only crop
and flip, and normalisation runs on the device in `Normalize`. That keeps the
CPU cost per image tiny, which matters on clusters with few cores per GPU.

Random augmentation is a pure function of (seed, epoch, sample index), so it does
not depend on the number of ranks or workers, or on whether the run was resumed.
"""
import functools
import hashlib
import os
import pickle
import signal
import socket
import tempfile
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision.datasets import CIFAR100
from torchvision.datasets.utils import check_integrity, download_url, extract_archive

from train_utils import UserError

# The official archive, exactly as torchvision downloads and verifies it. CIFAR100_URL in the
# environment points at a mirror instead (the md5 check still applies).
CIFAR100_URL = os.environ.get("CIFAR100_URL", CIFAR100.url)
CIFAR100_ARCHIVE = CIFAR100.filename  # cifar-100-python.tar.gz
CIFAR100_MD5 = CIFAR100.tgz_md5
CIFAR100_FOLDER = CIFAR100.base_folder  # cifar-100-python
# Per-channel statistics of the CIFAR-100 training set.
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
NUM_CLASSES = 100
PAD = 4  # random-crop padding, as in the WRN paper


@dataclass
class ImageData:
    """One split: `images` uint8 (N, 3, 32, 32), `labels` int64 (N,)."""
    images: torch.Tensor
    labels: torch.Tensor


# ----------------------------------------------------------------------------- CIFAR-100 on disk

def prepare_cifar100(data_dir: str) -> None:
    """Make sure data_dir/cifar-100-python/ exists: extract the archive, downloading it first if absent.

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
        if n == 0 or labels.min() < 0 or labels.max() >= NUM_CLASSES:
            raise ValueError(f"labels must lie in [0, {NUM_CLASSES})")
    except Exception as e:
        raise UserError(
            f"{path} is unreadable ({type(e).__name__}: {e}); delete {os.path.dirname(path)} to extract it again"
        ) from None
    return ImageData(data.view(n, 3, 32, 32).contiguous(), labels)


def make_synthetic(n: int, train: bool, seed: int = 0) -> ImageData:
    """Random images and labels with CIFAR-100's shapes and dtypes: for smoke runs and benchmarks."""
    g = torch.Generator().manual_seed(seed * 2 + int(train))
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (n,), dtype=torch.int64, generator=g)
    return ImageData(images, labels)


def load_split(dataset: str, data_dir: str, train: bool, size: int = 0) -> ImageData:
    """The train or test split of `dataset`, cut to its first `size` samples if size > 0."""
    if dataset == "synthetic":
        full = make_synthetic(size or (50_000 if train else 10_000), train)
    else:
        full = read_cifar100(data_dir, train)
    if size > len(full.labels):
        split = "train" if train else "test"
        raise UserError(f"--{split}-size {size} exceeds the {len(full.labels)} {split} samples of {dataset}")
    if size > 0:
        full = ImageData(full.images[:size].clone(), full.labels[:size].clone())
    return full


def fingerprint(data: ImageData) -> str:
    """A short hash of the samples themselves (about 0.2 s for CIFAR-100's 150 MB), stored in every
    checkpoint: a resume on other data is refused, whatever the flags or the data dir say."""
    h = hashlib.blake2b(digest_size=8)
    h.update(data.labels.numpy().tobytes())
    h.update(data.images.contiguous().numpy().data)
    return f"{len(data.labels)}:{h.hexdigest()}"


# ----------------------------------------------------------------------------- augmentation and loaders

_M64 = (1 << 64) - 1
_C0, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64


def _signed(c: int) -> int:
    return c - (1 << 64) if c >> 63 else c


def mix64(seed: int, epoch: int, idx):
    """splitmix64 of (seed, epoch, index): a well-mixed 64-bit hash that gives each sample its own
    random crop and flip. `idx` is a Python int (the CPU workers) or an int64 tensor (the device
    loader): both compute the same bits, so both loaders augment every sample identically."""
    if isinstance(idx, torch.Tensor):  # int64 wraps like uint64; mask arithmetic shifts into logical ones
        mul = lambda h, c: h * _signed(c)  # noqa: E731
        shr = lambda h, s: (h >> s) & ((1 << (64 - s)) - 1)  # noqa: E731
        h = torch.full_like(idx, _signed(_C0))
    else:
        mul = lambda h, c: (h * c) & _M64  # noqa: E731
        shr = lambda h, s: h >> s  # noqa: E731
        h = _C0
    for k in (seed, epoch, idx):
        h = mul(h ^ k, _C1)
        h = mul(h ^ shr(h, 31), _C2)
        h = h ^ shr(h, 29)
    return h


def crop_params(h):
    """Crop offsets (0..8 in the 40x40 padded image) and flip (0/1) from a hash, int or tensor."""
    return (h & 0xFFFF) % 9, ((h >> 16) & 0xFFFF) % 9, (h >> 32) & 1


def pad(images: torch.Tensor) -> torch.Tensor:
    """Zero-pad by PAD on each side, once up front, so that a random crop is a slice or a gather."""
    return torch.nn.functional.pad(images, (PAD,) * 4)


class CIFARDataset(Dataset):
    """uint8 images and labels. With `augment`, items are keyed (epoch, index) and get a random
    32x32 crop of the zero-padded 40x40 image and a random horizontal flip, drawn from
    hash(seed, epoch, index): the same for any number of ranks or workers."""

    def __init__(self, data: ImageData, augment: bool = False, seed: int = 0):
        self.labels, self.augment, self.seed = data.labels, augment, seed
        self.images = pad(data.images) if augment else data.images

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, key):
        if not self.augment:
            return self.images[key], self.labels[key]
        epoch, idx = key
        dx, dy, flip = crop_params(mix64(self.seed, epoch, idx))  # 9 x 9 offsets x 2 flips
        img = self.images[idx, :, dy:dy + 32, dx:dx + 32]
        return (img.flip(-1) if flip else img), self.labels[idx]


class EpochSampler:
    """Which samples each rank trains on at each step: a batch sampler of (epoch, index) keys.

    The epoch's order is randperm(seed + epoch), as in DistributedSampler. Global step s covers
    positions [s * batch, (s + 1) * batch) of that order, whatever the world size, so
    `set_epoch(epoch, start=p)` resumes at position p with exactly the samples the epoch has not
    yet seen, even on another number of ranks or with another batch size.

    Within a step the positions are dealt, like DistributedSampler's shards, to V = world_size x
    accum_steps virtual ranks: virtual rank v takes every V-th position from v. Rank r's k-th
    accumulation micro-step is virtual rank r + k x world_size, so W ranks x A micro-steps train
    on exactly the micro-batches that W x A ranks would. Each step yields rank r's A micro-batches
    back to back; the training step splits them (`micro_batch_sizes`). Nothing is padded or dropped:
    the epoch's last, short step deals what is left the same way, so some micro-batches there are
    one sample smaller, or empty, and every rank still takes the same number of steps."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, accum_steps: int = 1,
                 seed: int = 0):
        self.n, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size, self.accum_steps = rank, world_size, accum_steps
        self.virtual = world_size * accum_steps
        assert batch_size % self.virtual == 0, "the global batch splits into equal micro-batches"
        self.micro_batch = batch_size // self.virtual
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        rest = torch.randperm(self.n, generator=g).tolist()[self.start:]
        shards = [rest[self.rank + k * self.world_size::self.virtual] for k in range(self.accum_steps)]
        b = self.micro_batch
        for first in range(0, len(self) * b, b):
            yield [(self.epoch, i) for shard in shards for i in shard[first:first + b]]

    def __len__(self) -> int:
        return -(-max(self.n - self.start, 0) // self.batch_size)


def micro_batch_sizes(step_samples: int, rank: int, world_size: int, accum_steps: int) -> list:
    """The sizes of rank `rank`'s micro-batches in a global step of `step_samples` samples, as
    EpochSampler deals them: virtual rank v = rank + k * world_size takes every V-th sample from v."""
    v = world_size * accum_steps
    return [len(range(rank + k * world_size, step_samples, v)) for k in range(accum_steps)]


def _collate(shape, batch):
    """default_collate, and empty tensors for an empty batch (a rank with nothing left in the last step)."""
    if not batch:
        return torch.empty(0, *shape, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    return default_collate(batch)


def build_loaders(train: ImageData, test: ImageData, batch_size: int, rank: int, world_size: int,
                  accum_steps: int, eval_batch: int, seed: int, workers: int, pin_memory: bool, device=None):
    """The training loader (this rank's share of each global batch of `batch_size`, as `accum_steps`
    micro-batches back to back; call sampler.set_epoch each epoch) and the test loader (sharded
    without padding or dropping: every test image is scored exactly once, in batches of `eval_batch`).
    With `device`, both are DeviceLoaders over data held on that device; else DataLoaders."""
    sampler = EpochSampler(len(train.labels), batch_size, rank, world_size, accum_steps, seed)
    test_loader = build_test_loader(test, rank, world_size, eval_batch, workers, pin_memory, device)
    if device is not None:
        return DeviceLoader(train, device, sampler=sampler, seed=seed), test_loader
    # A private generator: a DataLoader otherwise draws its workers' seeds from the global RNG when
    # it starts an epoch, which would make dropout depend on whether the run was resumed.
    train_loader = DataLoader(CIFARDataset(train, augment=True, seed=seed), batch_sampler=sampler,
                              collate_fn=functools.partial(_collate, tuple(train.images.shape[1:])),
                              **_loader_options(workers, pin_memory, seed))
    return train_loader, test_loader


def build_test_loader(test: ImageData, rank: int, world_size: int, batch_size: int, workers: int,
                      pin_memory: bool, device=None):
    """Rank r scores test images r, r + world_size, ...: no padding, no dropping, maybe none at all."""
    shard = range(rank, len(test.labels), world_size)
    if device is not None:
        return DeviceLoader(test, device, indices=shard, batch_size=batch_size)
    return DataLoader(CIFARDataset(test), batch_size=batch_size, sampler=shard, **_loader_options(workers, pin_memory))


def _loader_options(workers: int, pin_memory: bool, seed: int = 0) -> dict:
    return dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
                generator=torch.Generator().manual_seed(seed), worker_init_fn=_ignore_ctrl_c if workers else None)


def _ignore_ctrl_c(worker_id: int) -> None:
    """Ctrl-C reaches the loader workers too (one process group); the main process turns it into a
    checkpointed stop, which needs them alive until then."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def crop_flip_batch(padded: torch.Tensor, idx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Batched random crop and flip, as tensor ops on the device: gather the images `idx` of the
    padded (N, 3, 40, 40) uint8 tensor, then their rows and (possibly mirrored) columns."""
    dx, dy, flip = crop_params(h)
    ar = torch.arange(32, device=padded.device)
    rows = dy[:, None] + ar
    cols = dx[:, None] + torch.where(flip[:, None].bool(), 31 - ar, ar)
    x = padded[idx]
    b, c = x.shape[:2]
    x = x.gather(2, rows[:, None, :, None].expand(b, c, 32, x.shape[3]))
    return x.gather(3, cols[:, None, None, :].expand(b, c, 32, 32))


class DeviceLoader:
    """The whole split lives on the device as uint8 (CIFAR-100 is 184 MB), and each batch is
    gathered and augmented there with tensor ops: no CPU workers, no host-to-device copies.
    Batches hold the same samples as the torch loader's (the same EpochSampler) with the same
    crops and flips (the same hash). For data that does not fit on the device, use --loader torch."""

    def __init__(self, data: ImageData, device, sampler=None, indices=None, batch_size: int = 0, seed: int = 0):
        self.sampler, self.batch_size, self.seed = sampler, batch_size, seed
        self.batch_sampler = sampler  # as DataLoader names it
        augment = sampler is not None
        images = pad(data.images) if augment else data.images
        self.images, self.labels = images.to(device), data.labels.to(device)
        self.indices = None if indices is None else torch.as_tensor(list(indices), dtype=torch.int64, device=device)

    def __len__(self):
        return len(self.sampler) if self.sampler is not None else -(-len(self.indices) // self.batch_size)

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
        for idx, hs in zip(order.split(sizes), h.split(sizes)):
            yield crop_flip_batch(self.images, idx, hs), self.labels[idx]


class Normalize(torch.nn.Module):
    """uint8 batch on the device -> normalised float, in the memory format the model wants."""

    def __init__(self, mean, std, device, channels_last: bool = False):
        super().__init__()
        std = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.shift = torch.tensor(mean, device=device).view(1, 3, 1, 1) / std
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().mul_(self.scale).sub_(self.shift)
        return x.contiguous(memory_format=self.memory_format)
