"""The data, in the order an adapter meets them: the contract (ImageData, DataSpec), the sources, the DDP samplers
(ShardSampler: torch's DistributedSampler unpadded; StepSampler: a step's micro-batches), the loaders. Images stay
uint8 until `Normalize` on the device. Each image's augmentation draws from mix64(seed, epoch, index), each
micro-batch's mix from (seed, epoch, step, virtual rank): the same for any ranks or workers, resumed or not."""
import functools
import itertools
import numbers
from dataclasses import dataclass, replace

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, default_collate

from machinery.data_checks import channel_stats, check_same_classes, class_names, stated_classes
from machinery.errors import UserError, call_and_agree
from machinery.hashing import mix64, seeded


CIFAR100_CLASSES = 100
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


@dataclass
class ImageData:
    """One split held in memory: `images` uint8 (N, C, H, W), `labels` int64 (N,); measure_data computes the rest."""
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int | None = None
    mean: tuple | None = None  # fractions of 255, as std
    std: tuple | None = None
    source: str | None = None  # for the records, e.g. "CIFAR-100 in ./datasets"

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class DataSpec:
    """What the data say of themselves; the model, normalisation and augmentation follow it (kept in checkpoints)."""
    channels: int
    height: int  # the first training image's: a Dataset's may differ
    width: int
    num_classes: int
    mean: tuple
    std: tuple
    classes: tuple | None = None  # the training split's class names, if it names them


def prepare_cifar100(data_dir: str, env=None) -> None:
    """Make data_dir/cifar-100-python/ on one process per node (the data dir may be node-local); all raise why not."""
    from machinery.cifar_archive import fetch_cifar100  # imported for CIFAR-100 only
    call_and_agree(fetch_cifar100, data_dir, here=env is None or env.local_rank == 0)


def make_synthetic(n: int, train: bool, seed: int = 0) -> ImageData:
    """Learnable images of CIFAR-100's shape and dtype: smoke runs then show learning."""
    from machinery.data_names import SYNTHETIC_SOURCE
    from machinery.synthetic import learnable_images
    images, labels = learnable_images(n, train, seed=seed, num_classes=CIFAR100_CLASSES)
    return ImageData(images, labels, num_classes=CIFAR100_CLASSES, source=SYNTHETIC_SOURCE)


def load_split(dataset: str, data_dir: str, train: bool, size: int = 0) -> ImageData:
    """The train or test split of `dataset` (CIFAR-100 as prepare_cifar100 extracted it), its first `size` if > 0."""
    if dataset == "synthetic":
        full = make_synthetic(size or (50_000 if train else 10_000), train)
    else:
        from machinery.cifar_archive import read_split
        images, labels = read_split(data_dir, train, num_classes=CIFAR100_CLASSES)
        full = ImageData(images, labels, num_classes=CIFAR100_CLASSES, mean=CIFAR100_MEAN, std=CIFAR100_STD,
                         source=f"CIFAR-100 in {data_dir}")
    if size > len(full):
        raise UserError(f"--{'train' if train else 'test'}-size {size} exceeds the {len(full)} samples of {dataset}")
    if size > 0:  # the stated classes and statistics stay
        full = replace(full, images=full.images[:size].clone(), labels=full.labels[:size].clone())
    return full


def folder_classes(root) -> list:
    """The classes of root/<class>/<image>, sorted, hidden ones left out: give both splits' image_folder them."""
    from machinery.image_folders import folder_classes as classes_of
    return classes_of(root)


def image_folder(root, classes: list | None = None, mode: str = "RGB", size=None, samples: int = 0):
    """A split of image files, root/<class>/<image>: torchvision's ImageFolder for folders as users have them. `mode`:
    "RGB" or "L"; `size`: (height, width) or one number to resize to; `samples`: that many, spread (0: all)."""
    from machinery.image_folders import ImageFolderSplit
    return ImageFolderSplit(str(root), classes=classes, mode=mode, size=size, samples=samples)


def mean_std(split, samples: int = 2000) -> tuple:
    """Per-channel mean and std / 255 of a Dataset, exact (the same on every rank), of `samples` spread (0: all)."""
    from machinery.image_folders import mean_std as stats_of
    return stats_of(split, samples)


def measure_data(train, test) -> DataSpec:
    """The DataSpec of load_data's splits, as stated, else computed exactly (a Dataset must state its mean and std).
    UserError, naming load_data, if the loaders cannot take the splits."""
    check_same_classes(class_names(train), test, "the training split")  # first: it reads no sample
    shape, test_shape = check_split(train, "training"), check_split(test, "test")
    if test_shape[0] != shape[0]:  # sizes may differ: the transforms make the model's (check_transforms)
        raise UserError(f"load_data gives {shape[0]}-channel training images, {test_shape[0]}-channel test images: "
                        f"both splits must have one number of channels; give both {shape[0]} in load_data")
    labels = [(name, split, split.labels if isinstance(split, ImageData) else getattr(split, "targets", None))
              for split, name in ((train, "training"), (test, "test"))]
    num_classes = stated_classes(train) or stated_classes(test)
    if not num_classes:  # 1 + the largest label of either split, which must list them
        for _, split, split_labels in labels:
            if split_labels is None:
                raise UserError(f"load_data's {type(split).__name__} states no number of classes: set its "
                                f".num_classes (or .classes, or .targets, the list of its labels) in load_data")
        num_classes = 1 + max(int(torch.as_tensor(t).max()) for _, _, t in labels)
    for name, _, split_labels in labels:
        if split_labels is None or not len(split_labels):
            continue
        low, high = int(torch.as_tensor(split_labels).min()), int(torch.as_tensor(split_labels).max())
        if not 0 <= low <= high < num_classes:
            raise UserError(f"load_data's {name} labels span [{low}, {high}], outside [0, {num_classes}) for "
                            f"{num_classes} classes: labels must be class indices 0, 1, ...")
    mean, std = getattr(train, "mean", None), getattr(train, "std", None)
    if mean is None or std is None:
        if not isinstance(train, ImageData):
            raise UserError(f"load_data's training {type(train).__name__} states no per-channel mean and std (it "
                            f"would be read whole): set its .mean and .std ({shape[0]} fractions of 255) in load_data")
        mean, std = channel_stats(train.images)
    if len(mean) != shape[0] or len(std) != shape[0] or min(std) <= 0:
        raise UserError(f"load_data states mean {tuple(mean)} and std {tuple(std)}: each needs {shape[0]} "
                        f"values (one per channel), and std must be positive")
    return DataSpec(*shape, num_classes=int(num_classes), mean=tuple(map(float, mean)),
                    std=tuple(map(float, std)), classes=class_names(train))


@dataclass
class CheckedData:
    """load_data's splits (train: None for --evaluate), spec and fingerprints, checked against the checkpoint."""
    train: object
    test: object
    spec: DataSpec
    fingerprints: dict
    device: object  # a torch.device, or None for DataLoader workers
    val: object = None  # --val-size's held-out training samples (hold_out)
    source: str = ""  # for the records (describe_source)
    draws: str = ""  # the training augmentation's draws (build_loaders), kept in checkpoints
    sizes: str = ""  # for the Data line: `3 x 32 x 32`, or a range (check_sizes)


def load_checked_data(load_data, cfg, env, found, train: bool = True) -> CheckedData:
    """load_data(cfg, env, train) on every rank, measured and checked to be the data the checkpoint in `found`
    trained on. Without a training split (--evaluate) the spec is the checkpoint's."""
    train_data, test_data = call_and_agree(load_data, cfg, env, train)
    if train:
        spec = call_and_agree(measure_data, train_data, test_data)
        shape = {k: getattr(spec, k) for k in ("channels", "height", "width", "num_classes")}
    else:  # the channels must match (the transforms make the model's size); the fingerprint checks the images
        shape = {"channels": call_and_agree(check_split, test_data, "test")[0]}
        spec = DataSpec(**found.ckpt["config"]["data_spec"])
        call_and_agree(check_same_classes, spec.classes, test_data, "the checkpoint's training split")
    splits = {"train": train_data, "test": test_data} if train else {"test": test_data}
    from machinery.resume import check_same_data, check_same_splits, fingerprint
    fingerprints = {name: fingerprint(split) for name, split in splits.items()}
    check_same_splits(fingerprints)  # on every rank: the samplers share one split out
    if found is not None and found.ckpt is not None:  # never continue on other data
        call_and_agree(check_same_data, found, shape, fingerprints)
    device = loader_device(cfg, env, *splits.values())
    source = describe_source(train_data if train else test_data)
    from machinery.data_names import check_sizes  # the Data line's; a note for a size flag load_data ignored
    sizes = check_sizes(cfg, train_data if train else None, test_data, spec.channels)
    val_data = None
    if train and cfg.val_size:
        train_data, val_data = call_and_agree(hold_out, train_data, cfg.val_size)
    return CheckedData(train_data, test_data, spec, fingerprints, device, val_data, source, sizes=sizes)


def loader_device(cfg, env, *splits):
    """env.device to keep ImageData there (--loader gpu, or auto on CUDA), else None: DataLoader workers, checked."""
    in_memory = all(isinstance(s, ImageData) for s in splits)  # a Dataset is read by the workers
    if cfg.loader == "gpu" and not in_memory:
        raise UserError("--loader gpu needs the data in memory (dataset_utils.ImageData), but load_data returned a "
                        "Dataset: use --loader torch (or auto)")
    if in_memory and (cfg.loader == "gpu" or (cfg.loader == "auto" and env.device.type == "cuda")):
        return env.device
    from machinery.loader_workers import check_worker_sockets
    call_and_agree(check_worker_sockets, cfg.num_workers)


def describe_source(split) -> str:  # for the records
    while isinstance(split, Subset):
        split = split.dataset
    if isinstance(split, ImageData):
        return split.source or "ImageData from load_data"
    root = getattr(split, "root", None)
    return f"{type(split).__name__} of {root}" if root else f"{type(split).__name__} from load_data"


def hold_out(train, size: int) -> tuple:
    """(the rest, `size` held-out samples) of the training split: one permutation for every rank and run, whatever
    --seed, so runs compare on one validation split."""
    if size >= len(train):
        raise UserError(f"--val-size {size} leaves no training samples of the {len(train)}: hold out fewer")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    kept, held = order[size:].sort().values, order[:size].sort().values
    if isinstance(train, ImageData):
        return (replace(train, images=train.images[kept], labels=train.labels[kept]),
                replace(train, images=train.images[held], labels=train.labels[held]))
    from machinery.bad_samples import Share  # its bad samples named by their index in `train`
    return Share(train, kept.tolist()), Share(train, held.tolist())


def check_split(split, name: str) -> tuple:
    """(channels, height, width) of a split's images; UserError if the loaders cannot take it."""
    if isinstance(split, ImageData):
        images, labels = split.images, split.labels
        if (images.dtype != torch.uint8 or images.dim() != 4 or labels.dtype != torch.int64
                or labels.shape != (len(images),)):
            raise UserError(f"load_data's {name} ImageData: images {tuple(images.shape)} {images.dtype}, labels "
                            f"{tuple(labels.shape)} {labels.dtype}; needs uint8 images (N, C, H, W), int64 labels (N,)")
    elif not (hasattr(split, "__getitem__") and hasattr(split, "__len__")):
        raise UserError(f"load_data returned a {type(split).__name__} as the {name} split: return "
                        f"dataset_utils.ImageData, or a Dataset of (uint8 C x H x W tensor, label)")
    if len(split) == 0:
        raise UserError(f"load_data's {name} split is empty")
    if isinstance(split, ImageData):
        return tuple(split.images.shape[1:])
    from machinery.bad_samples import first_readable  # samples may not read
    item, first = first_readable(split, name)
    image, label = item if isinstance(item, (tuple, list)) and len(item) == 2 else (item, None)
    integer_label = isinstance(label, numbers.Integral) or (
        isinstance(label, torch.Tensor) and label.dim() == 0 and not label.is_floating_point())
    if not (isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3 and integer_label):
        got = f"{type(image).__name__} {tuple(getattr(image, 'shape', ()))} {getattr(image, 'dtype', '')}".strip()
        raise UserError(f"load_data's {name} {type(split).__name__} yields ({got}, {type(label).__name__}) "
                        f"as item {first}: it must yield (uint8 tensor C x H x W, integer label); for image "
                        f"files, ImageFolder(root, transform=torchvision.transforms.v2.PILToTensor())")
    return tuple(image.shape)


class ShardSampler:
    """torch's DistributedSampler (rank r takes positions r, r + num_replicas, ... of the epoch's order), unpadded
    (each sample counts once), and start_at(start), after set_epoch: the epoch from `start` on (a resumed epoch's)."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler, self.size, self.num_replicas = sampler, len(sampler.dataset), sampler.num_replicas
        self.virtual_rank, self.start = sampler.rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.start_at(0)

    def start_at(self, start: int) -> None:
        # This rank's first sample is the one at start + rank, which torch's share of rank (start + rank) %
        # num_replicas holds (another rank where a run resumes on another batch size or world size).
        self.start, self.sampler.rank = start, (start + self.virtual_rank) % self.num_replicas

    def __iter__(self):
        positions = range(self.sampler.rank, self.sampler.total_size, self.num_replicas)  # torch pads past self.size
        return (i for p, i in zip(positions, self.sampler) if self.start <= p < self.size)

    def __len__(self) -> int:
        return len(range(self.start + self.virtual_rank, self.size, self.num_replicas))


class StepSampler:
    """The training loader's batch sampler: each global step, this rank's micro-batches (one per virtual rank's shard)
    as (epoch, index) keys. Step s covers positions [start + s x batch, start + (s + 1) x batch) of the epoch's order
    for any world size, so a resume on any ranks or batch size trains exactly the samples the epoch has not seen. The
    short last step is dealt alike: every rank takes as many steps."""

    def __init__(self, shards: list, *, batch_size: int):
        self.shards, self.batch_size, self.num_samples = shards, batch_size, shards[0].size
        self.rank, self.accum_steps = shards[0].virtual_rank, len(shards)  # shard k: virtual rank rank + k x W
        self.world_size = shards[0].num_replicas // self.accum_steps
        assert batch_size % shards[0].num_replicas == 0, "the global batch splits into equal micro-batches"
        self.epoch, self.start, self.skipped = 0, 0, []

    def set_epoch(self, epoch: int) -> None:
        for shard in self.shards:
            shard.set_epoch(epoch)
        self.epoch, self.start, self.skipped = epoch, 0, []

    def start_at(self, position: int, skipped: list | None = None) -> None:
        """What a resume adds, after set_epoch: the epoch from `position` on; `skipped`: its unreadable samples."""
        for shard in self.shards:
            shard.start_at(position)
        self.start, self.skipped = position, skipped if skipped is not None else []

    def step_split(self, position: int, skipped=()) -> tuple:
        """(samples, this rank's micro-batch sizes) of the global step at `position`, less the `skipped` BadSamples."""
        step_samples = min(self.batch_size, self.num_samples - position)
        sizes = [len(r) for r in deal_step(step_samples, self.rank, self.world_size, self.accum_steps)]
        ends = [sum(sizes[:k + 1]) for k in range(len(sizes))]
        for bad in skipped:
            sizes[next(k for k, end in enumerate(ends) if bad.slot < end)] -= 1
        return step_samples, sizes

    def __iter__(self):
        shares, micro_batch = [iter(shard) for shard in self.shards], self.batch_size // self.shards[0].num_replicas
        for _ in range(len(self)):
            yield [(self.epoch, i) for share in shares for i in itertools.islice(share, micro_batch)]

    def __len__(self) -> int:
        return -(-max(self.num_samples - self.start, 0) // self.batch_size)


def deal_step(step_samples: int, rank: int, world_size: int, accum_steps: int) -> list:
    """A step's positions for `rank`'s micro-steps: micro-step k, virtual rank v = rank + k x world_size, every V-th
    from v (V = world_size x accum_steps)."""
    v = world_size * accum_steps
    return [range(rank + k * world_size, step_samples, v) for k in range(accum_steps)]


class Mix:
    """`batch_transform` (MixUp, CutMix or a RandomChoice of them) on each micro-batch, drawn from (seed, epoch, the
    step's first position, the micro-batch's virtual rank): as W x A ranks would mix. Labels become soft targets."""

    def __init__(self, batch_transform, *, num_classes: int, seed: int, rank: int, world_size: int):
        self.batch_transform, self.num_classes = batch_transform, num_classes
        self.seed, self.rank, self.world_size = seed, rank, world_size

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, *, epoch: int, position: int,
                 micro_sizes: list) -> tuple:
        out = []
        for k, (x, y) in enumerate(zip(images.split(micro_sizes), labels.split(micro_sizes))):
            key = mix64(mix64(self.seed, epoch, position + self.rank + k * self.world_size), 3, 0)  # 3: not the images'
            out.append(seeded(self.batch_transform, (x.float(), y), key) if len(y)  # an empty micro-batch: as it is
                       else (x.float(), y.new_zeros(0, self.num_classes, dtype=torch.float32)))
        return torch.cat([x for x, _ in out]), torch.cat([y for _, y in out])

    def mix_step(self, loader, step: int, images: torch.Tensor, labels: torch.Tensor) -> tuple:
        """The training loader's `step`-th batch of this pass."""
        sampler = loader.batch_sampler
        position = sampler.start + step * sampler.batch_size  # where the step starts in the epoch's order
        _, micro_sizes = loader.step_split(position)
        return self(images, labels, epoch=sampler.epoch, position=position, micro_sizes=micro_sizes)


class CropFlip:
    """The default training transform (build_transforms'): the device loader runs it batched (crop_flip_batch, `pad`
    each side, images of `size`: the views torchvision's ops give); DataLoader workers run `per_image` per image."""

    def __init__(self, per_image, *, pad: tuple, size: tuple):
        self.per_image, self.pad, self.size = per_image, tuple(pad), tuple(size)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self.per_image(image)


def crop_padding(height: int, width: int) -> tuple:
    """The random crop's zero padding (rows, columns) each side: an eighth (4 for 32, as the WRN paper), at least 1."""
    return max(1, height // 8), max(1, width // 8)


def crop_flip_batch(images: torch.Tensor, idx: torch.Tensor, h: torch.Tensor, pad: tuple) -> torch.Tensor:
    """Images `idx` of the padded uint8 tensor, cropped at offsets drawn from hashes h, maybe mirrored: gathers."""
    pad_y, pad_x = pad
    dx, dy, flip = (h & 0xFFFF) % (2 * pad_x + 1), ((h >> 16) & 0xFFFF) % (2 * pad_y + 1), (h >> 32) & 1
    height, width = images.shape[-2] - 2 * pad_y, images.shape[-1] - 2 * pad_x
    across = torch.arange(width, device=images.device)
    rows = dy[:, None] + torch.arange(height, device=images.device)
    cols = dx[:, None] + torch.where(flip[:, None].bool(), width - 1 - across, across)
    x = images[idx]
    b, c = x.shape[:2]
    x = x.gather(2, rows[:, None, :, None].expand(b, c, height, x.shape[3]))
    return x.gather(3, cols[:, None, None, :].expand(b, c, height, width))


class ImageDataset(Dataset):
    """A split for the DataLoader: ImageData, or a Dataset whose unreadable samples come as BadSamples; each image
    through `transform` seeded by mix64(seed, epoch, index). One the transform does not make `shape` is bad too."""

    def __init__(self, data, transform=None, seed: int = 0, split: str = "training", shape=None):
        self.data, self.transform, self.seed, self.split = data, transform, seed, split
        self.in_memory = isinstance(data, ImageData)
        first, any_size = tuple(data.images.shape[1:]) if self.in_memory else None, False
        if not self.in_memory:  # read by the workers: an unreadable sample comes as a BadSample
            from machinery.bad_samples import first_readable
            first = tuple(first_readable(data, split)[0][0].shape)
            # photos through your transform; the default crop is for images of the data's size
            any_size = transform is not None and not (isinstance(transform, CropFlip) and transform.size == first[1:])
        self.image_shape = tuple(shape or first) if transform is not None else first
        self.read_shape = (first[0], None, None) if any_size else first

    def __len__(self):
        return len(self.data)

    def __getitem__(self, key):
        from machinery.bad_samples import read_sample, transform_sample
        epoch, idx = key if isinstance(key, tuple) else (0, key)
        if self.in_memory:
            image, label = self.data.images[idx], self.data.labels[idx]
        else:
            item = read_sample(self.data, idx, self.split, self.read_shape)
            if not isinstance(item, tuple):  # a BadSample
                return item
            image, label = item[0], int(item[1])  # int64 once collated
        if self.transform is not None:
            image = transform_sample(self.data, idx, self.split, self.transform, image,
                                     seed=mix64(self.seed, epoch, idx), shape=self.image_shape)
            if not isinstance(image, torch.Tensor):  # a BadSample
                return image
        return image, label


def _collate(shape, batch):
    """(images, labels, unreadable): the samples that read, collated (empty of `shape` if none), and the BadSamples."""
    unreadable = [replace(b, slot=i) for i, b in enumerate(batch) if not isinstance(b, tuple)]  # BadSamples
    good = [b for b in batch if isinstance(b, tuple)]  # a sample that read: (image, label)
    if not good:
        return torch.empty(0, *shape, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), unreadable
    return (*default_collate(good), unreadable)


def build_loaders(data, cfg, env, transforms=(None, None, None)) -> tuple:
    """(train, test, val) loaders of `data` for this rank (`transforms`: build_transforms'). train (None for
    --evaluate) yields its share of each global batch as micro-batches; test and val (None without --val-size) score
    each image once. DeviceLoaders with data.device; else AgreedLoaders, which skip unreadable samples."""
    from machinery.transform_checks import check_transforms, where_transform_runs, workers_take
    train_tf, test_tf, batch_tf = transforms
    shape = call_and_agree(check_transforms, data, train_tf, test_tf)  # what they return, before the first step
    device, in_memory_train = data.device, data.device is not None and data.train is not None
    # build_transforms' default (CropFlip): batched on the device, for images of the size it was made for
    batched = (in_memory_train and isinstance(train_tf, CropFlip)
               and train_tf.size == tuple(data.train.images.shape[2:]))
    if in_memory_train and train_tf is not None and not batched:
        device = where_transform_runs(device=device, loader=cfg.loader, workers=cfg.num_workers)
    if device is None:  # DataLoader workers: the transforms must pickle; a Dataset's transform said where it runs
        workers_take(data.train, train_tf, test_tf, workers=cfg.num_workers)
    test = build_test_loader(data.test, cfg, env, device=device, transform=test_tf, shape=shape)
    val = None if data.val is None else build_test_loader(data.val, cfg, env, device, "validation", test_tf, shape)
    if data.train is None:
        return None, test, val
    seed = cfg.seed
    # torch's DistributedSampler deals each epoch's order to world_size x accumulation_steps virtual ranks: micro-step
    # k of rank r is virtual rank r + k x world_size, so W ranks x A micro-steps train as W x A ranks would.
    virtual_ranks = env.world_size * cfg.accumulation_steps
    shards = [ShardSampler(DistributedSampler(range(len(data.train)), num_replicas=virtual_ranks,
                                              rank=env.rank + k * env.world_size, shuffle=True, seed=seed))
              for k in range(cfg.accumulation_steps)]
    sampler = StepSampler(shards, batch_size=cfg.batch_size)
    data.draws = ("the device loader's crop and flip, from a hash" if batched else
                  "torchvision's ops, seeded per image and micro-batch")
    mix = None if batch_tf is None else Mix(batch_tf, num_classes=data.spec.num_classes, seed=seed,
                                             rank=env.rank, world_size=env.world_size)
    if device is not None:
        return (DeviceLoader(data.train, device, sampler=sampler, seed=seed, transform=train_tf, mix=mix,
                             batched_crop_flip=batched, shape=shape), test, val)
    dataset = ImageDataset(data.train, transform=train_tf, seed=seed, shape=shape)
    train = DataLoader(dataset, batch_sampler=sampler, collate_fn=functools.partial(_collate, shape),
                       **_loader_options(cfg.num_workers, env.cuda, seed))
    return AgreedLoader(train, limit=cfg.skip_bad_samples, mix=mix), test, val


def build_test_loader(split, cfg, env, device=None, split_name: str = "test", transform=None, shape=None):
    """Rank r scores images r, r + world_size, ... (DistributedSampler's shard, unshuffled, unpadded)."""
    shard = ShardSampler(DistributedSampler(range(len(split)), num_replicas=env.world_size, rank=env.rank,
                                            shuffle=False))
    if device is not None:
        return DeviceLoader(split, device, indices=shard, batch_size=cfg.eval_batch, transform=transform,
                            split=split_name, shape=shape)
    dataset = ImageDataset(split, transform=transform, split=split_name, shape=shape)
    options = _loader_options(cfg.num_workers, env.cuda)
    return AgreedLoader(DataLoader(dataset, batch_size=cfg.eval_batch, sampler=shard, **options,
                                   collate_fn=functools.partial(_collate, shape or dataset.image_shape)))


def _loader_options(workers: int, pin_memory: bool, seed: int = 0) -> dict:
    """The workers start from a forkserver (machinery/loader_workers.py), so a Dataset must be top-level."""
    options = dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
                   generator=torch.Generator().manual_seed(seed))
    if workers:  # they ignore the stop signals: the rank decides when to stop (machinery/loader_workers.py)
        from machinery.loader_workers import deaf_to_stop_signals, worker_context
        options.update(worker_init_fn=deaf_to_stop_signals, multiprocessing_context=worker_context())
    return options


class AgreedLoader:
    """A DataLoader over ImageDataset yielding (images, labels) less the unreadable samples, on which the ranks agree
    in check() (at the loop's stop checks and after the last batch): each logged and skipped, up to `limit` an
    epoch; past it, or for a test sample, every rank raises UserError."""

    def __init__(self, loader: DataLoader, limit: int = 0, mix=None):
        self.loader, self.limit, self.mix = loader, limit, mix
        self.batch_sampler = loader.batch_sampler if isinstance(loader.batch_sampler, StepSampler) else None
        self.found, self.gaps = [], []  # unreadable since the last check; the last batch's

    def __len__(self):
        return len(self.loader)

    def step_split(self, position: int) -> tuple:
        return self.batch_sampler.step_split(position, skipped=self.gaps)

    def __iter__(self):
        from machinery.loader_workers import start_workers  # a stop signal sent to all reaches the rank alone
        for step, (images, labels, unreadable) in enumerate(start_workers(self.loader)):
            self.gaps = unreadable
            self.found += unreadable
            if self.mix is not None:
                images, labels = self.mix.mix_step(self, step, images, labels)
            yield images, labels
        self.check()

    def check(self) -> None:
        """A collective, but for data held in memory, which all read."""
        if self.loader.dataset.in_memory:
            return
        from machinery.bad_samples import check_unreadable
        skipped = self.batch_sampler.skipped if self.batch_sampler else []
        check_unreadable(self.found, skipped=skipped, limit=self.limit if self.batch_sampler else 0)


class DeviceLoader:
    """The whole split on the device as uint8 (CIFAR-100: 184 MB), each batch gathered and augmented there: the torch
    loader's samples and seeds, the default crop and flip batched. For data that do not fit: --loader torch."""

    def __init__(self, data: ImageData, device, sampler=None, indices=None, batch_size: int = 0,
                 seed: int = 0, transform=None, mix=None, batched_crop_flip: bool = False,
                 split: str = "training", shape=None):
        self.sampler = self.batch_sampler = sampler  # batch_sampler: as DataLoader names it
        self.batch_size, self.seed, self.mix, self.transform, self.split = batch_size, seed, mix, transform, split
        self.shape = tuple(shape or data.images.shape[1:])  # what `transform` must return (check_transforms')
        self.pad, images = None, data.images
        if batched_crop_flip:  # CropFlip, batched
            self.pad = crop_padding(*images.shape[-2:])  # padded once, up front
            images = torch.nn.functional.pad(images, (self.pad[1], self.pad[1], self.pad[0], self.pad[0]))
        self.images, self.labels = images.to(device), data.labels.to(device)
        self.indices = None if indices is None else torch.as_tensor(list(indices), dtype=torch.int64, device=device)

    def __len__(self):
        return len(self.sampler) if self.sampler is not None else -(-len(self.indices) // self.batch_size)

    def step_split(self, position: int) -> tuple:
        return self.sampler.step_split(position)

    def check(self) -> None:
        """Nothing to agree on: data held in memory all read."""

    def per_image(self, idx: torch.Tensor, epoch: int) -> torch.Tensor:
        if self.transform is None:
            return self.images[idx]
        from machinery.bad_samples import transform_image  # UserError if it does not return self.shape
        return torch.stack([transform_image(self.transform, self.images[i], idx=i, split=self.split, shape=self.shape,
                                            seed=mix64(self.seed, epoch, i)) for i in idx.tolist()])

    def __iter__(self):
        if self.sampler is None:
            for idx in self.indices.split(self.batch_size):
                yield self.per_image(idx, 0), self.labels[idx]
            return
        steps = list(self.sampler)  # the epoch's order to the device at once: one copy, not one per step
        order = torch.tensor([i for keys in steps for _, i in keys], dtype=torch.int64).to(self.images.device)
        epoch, sizes = self.sampler.epoch, [len(keys) for keys in steps]
        for step, (idx, hs) in enumerate(zip(order.split(sizes), mix64(self.seed, epoch, order).split(sizes))):
            images = (crop_flip_batch(self.images, idx, hs, self.pad) if self.pad is not None
                      else self.per_image(idx, epoch))
            labels = self.labels[idx]
            if self.mix is not None:
                images, labels = self.mix.mix_step(self, step, images, labels)
            yield images, labels


class Normalize(torch.nn.Module):
    """uint8 batch on the device -> normalised float, in the memory format the model wants."""

    def __init__(self, mean, std, device, channels_last: bool = False):
        super().__init__()
        std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.shift = torch.tensor(mean, device=device).view(1, -1, 1, 1) / std
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().mul_(self.scale).sub_(self.shift)
        return x.contiguous(memory_format=self.memory_format)
