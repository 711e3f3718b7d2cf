"""The augmentation's crop and flip, drawn from a hash of (seed, epoch, sample index), never from a random
generator's state: so a run trains the same on any number of ranks (W ranks x A micro-steps as W x A ranks), a
resume mid-epoch is bit-identical, and the DataLoader workers (one image at a time) and the device loader (a
batch at once) cut the same pixels. The modern recipe's ops draw from the same hash (machinery/augment_ops.py,
loaded when their flags are on). The images stay uint8 until the device normalises them.
"""
import torch

from machinery.hashing import mix64, signed  # noqa: F401 - the loaders take them from here

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
