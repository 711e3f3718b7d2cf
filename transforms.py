"""Where the augmentation's random draws take their seed, whatever op draws them: each training image's from a hash of
(seed, epoch, index), each micro-batch's mixing from (seed, epoch, step, virtual rank). So a run trains the same on any
number of ranks (W ranks x A micro-steps as W x A ranks), and a resume mid-epoch is bit-identical. The ops are
torchvision's (train_ddp.build_transforms); the one kept here is the device loader's batched crop and flip, which no
torchvision op does per image within a batch. The images stay uint8 until the device normalises them.
"""
import torch

from machinery.hashing import mix64, seeded  # seeded(transform, inputs, seed): torch's generator seeded

_SALT_MIX = 3  # the micro-batch's seed, apart from the images'


def image_seed(seed: int, epoch: int, idx: int) -> int:
    """The seed of training image `idx`'s draws in `epoch`."""
    return mix64(seed, epoch, idx)


class Mix:
    """`batch_transform` (torchvision's MixUp, CutMix or a RandomChoice of them) on each micro-batch of a step, drawn
    from (seed, epoch, the step's first position in the epoch's order, the micro-batch's virtual rank r + k x W): the
    micro-batches are those of W x A ranks (StepSampler), so is their mixing. Images become float (0-255), labels
    soft targets (N, classes)."""

    def __init__(self, batch_transform, *, num_classes: int, seed: int, rank: int, world_size: int):
        self.batch_transform, self.num_classes = batch_transform, num_classes
        self.seed, self.rank, self.world_size = seed, rank, world_size

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, *, epoch: int, position: int,
                 micro_sizes: list) -> tuple:
        out_images, out_labels = [], []
        for k, (x, y) in enumerate(zip(images.split(micro_sizes), labels.split(micro_sizes))):
            key = mix64(mix64(self.seed, epoch, position + self.rank + k * self.world_size), _SALT_MIX, 0)
            x, y = (seeded(self.batch_transform, (x.float(), y), key) if len(y)  # an empty micro-batch: as it is
                    else (x.float(), y.new_zeros(0, self.num_classes, dtype=torch.float32)))
            out_images.append(x)
            out_labels.append(y)
        return torch.cat(out_images), torch.cat(out_labels)

    def mix_step(self, loader, step: int, images: torch.Tensor, labels: torch.Tensor) -> tuple:
        """The training loader's `step`-th batch of this pass, mixed within each micro-batch (the loader's
        step_split: unread samples left out)."""
        sampler = loader.batch_sampler
        position = sampler.start + step * sampler.batch_size  # where the step starts in the epoch's order
        _, micro_sizes = loader.step_split(position)
        return self(images, labels, epoch=sampler.epoch, position=position, micro_sizes=micro_sizes)


# The device loader's crop and flip, for the default training transform (zero-pad an eighth of each side, crop back,
# mirror on one bit), which build_transforms returns as a CropFlip: the same views torchvision's RandomCrop and
# RandomHorizontalFlip give, drawn from the hash.

class CropFlip:
    """The default training transform, chosen in train_ddp.build_transforms: the device loader runs it batched on the
    GPU (crop_flip_batch, `pad` rows and columns each side, images of `size`); DataLoader workers run `per_image`
    (torchvision's RandomCrop and RandomHorizontalFlip) on each image."""

    def __init__(self, per_image, *, pad: tuple, size: tuple):
        self.per_image, self.pad, self.size = per_image, tuple(pad), tuple(size)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self.per_image(image)


def crop_padding(height: int, width: int) -> tuple:
    """The random crop's zero padding (rows, columns) on each side for an image of this size (4 for 32, as in the
    WRN paper; at least 1)."""
    return max(1, height // 8), max(1, width // 8)


def crop_flip_batch(images: torch.Tensor, idx: torch.Tensor, h: torch.Tensor, pad: tuple) -> torch.Tensor:
    """The images `idx` of the padded (N, C, H + 2 pad_y, W + 2 pad_x) uint8 tensor, each cropped back to H x W at
    an offset drawn from its hash h and maybe mirrored: gathers on the device."""
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
