"""The modern recipe's augmentations, drawn from the hash (machinery/hashing.py), in integer arithmetic so that
the same draws give the same bits on any device and in any batch: TrivialAugmentWide and random erasing per
sample (Augment), mixup and cutmix per micro-batch (Mix). Loaded only when their flags are on
(dataset_utils.build_loaders)."""
import math

import numpy as np
import torch

from machinery.hashing import mix64


def _bits(h: torch.Tensor, shift: int, n: int) -> torch.Tensor:
    """n bits of the int64 hashes h from bit `shift` (shift + n <= 63)."""
    return (h >> shift) & ((1 << n) - 1)


# ------------------------------------------------------------- per sample: TrivialAugmentWide, random erasing

# TrivialAugmentWide (Mueller & Hutter 2021; torchvision's TrivialAugmentWide): one op per image, drawn
# uniformly, at one of 31 magnitudes, signed where marked, with torchvision's ranges and nearest-neighbour
# geometry, zero fill.
TA_WIDE = (("identity", 0.0, False), ("shear_x", 0.99, True), ("shear_y", 0.99, True),
           ("translate_x", 32.0, True), ("translate_y", 32.0, True), ("rotate", 135.0, True),
           ("brightness", 0.99, True), ("color", 0.99, True), ("contrast", 0.99, True),
           ("sharpness", 0.99, True), ("posterize", 0.0, False), ("solarize", 0.0, False),
           ("autocontrast", 0.0, False), ("equalize", 0.0, False))
BINS = 31
ONE = 1 << 16  # the affine matrices' fixed point
# torchvision's RandomErasing: area fraction, aspect ratio
ERASE_SCALE, ERASE_RATIO = (0.02, 0.33), (0.3, 3.3)
_SALT_TA, _SALT_ERASE, _SALT_MIX = 1, 2, 3


class Augment:
    """After the crop and flip: TrivialAugmentWide (`auto_augment` "ta_wide") and random erasing (with
    probability `random_erase`: a box of 2-33% of the image, aspect ratio 0.3-3.3, filled with `fill`, the
    data's mean colour: 0 once normalised, as torchvision's RandomErasing(value=0) after Normalize), each
    drawn from a sample's hash. Call on a uint8 batch (N, C, H, W) and its int64 hashes (N,)."""

    def __init__(self, image_shape: tuple, *, auto_augment: str | None = None, random_erase: float = 0.0,
                 fill: tuple = (0,)):
        channels, height, width = image_shape
        self.auto_augment, self.random_erase = auto_augment, random_erase
        self.tables = {
            "fill": torch.tensor(fill, dtype=torch.uint8).view(1, -1, 1, 1).expand(1, channels, 1, 1)}
        if auto_augment:
            self.tables.update(_ta_tables(height, width))
        if random_erase:
            self.tables["erase"] = _erase_table(height, width)
        self._on = {}  # the tables, per device

    @property
    def active(self) -> bool:
        return bool(self.auto_augment or self.random_erase)

    def __call__(self, images: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if not self.active or not len(images):
            return images
        device = images.device
        if device not in self._on:
            self._on[device] = {k: t.to(device) for k, t in self.tables.items()}
        tables = self._on[device]
        if self.auto_augment:
            images = trivial_augment(images, mix64(_SALT_TA, 0, h), tables)
        if self.random_erase:
            images = random_erase(images, mix64(_SALT_ERASE, 0, h), tables, p=self.random_erase)
        return images


def _ta_tables(height: int, width: int) -> dict:
    """Per (op, magnitude bin, sign): the affine map from an output pixel to its source pixel (6 fixed-point
    ints), the blend factor x 256, the posterize mask and the solarize threshold: identity where the op is
    another."""
    affine, factor, mask, threshold = [], [], [], []
    cx, cy = (width - 1) / 2, (height - 1) / 2
    for name, top, signed in TA_WIDE:
        for b in range(BINS):
            for sign in (1, -1):
                m = top * b / (BINS - 1) * (sign if signed else 1)
                a = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # source x = a0 x + a1 y + a2, source y = a3 x + a4 y + a5
                if name == "shear_x":
                    a[1] = -m
                elif name == "shear_y":
                    a[3] = -m
                elif name == "translate_x":
                    a[2] = -float(int(m))
                elif name == "translate_y":
                    a[5] = -float(int(m))
                elif name == "rotate":
                    c, s = math.cos(math.radians(m)), math.sin(math.radians(m))
                    a = [c, s, cx - c * cx - s * cy, -s, c, cy + s * cx - c * cy]
                affine.append([round(v * ONE) for v in a])
                blend = name in ("brightness", "color", "contrast", "sharpness")
                factor.append(round((1.0 + m) * 256) if blend else 256)
                bits = 8 - round(b / ((BINS - 1) / 6)) if name == "posterize" else 8
                mask.append((0xFF << (8 - bits)) & 0xFF)
                threshold.append(math.ceil(255.0 * (1 - b / (BINS - 1))) if name == "solarize" else 256)
    as_int = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return {"affine": as_int(affine), "factor": as_int(factor), "mask": as_int(mask),
            "threshold": as_int(threshold)}


def trivial_augment(x: torch.Tensor, h: torch.Tensor, tables: dict) -> torch.Tensor:
    """One TrivialAugmentWide op per image of the uint8 batch x, drawn from the hashes h; integer
    arithmetic."""
    n, c, height, width = x.shape
    op, b, sign = _bits(h, 0, 16) % len(TA_WIDE), _bits(h, 16, 16) % BINS, _bits(h, 32, 1)
    row = (op * BINS + b) * 2 + sign
    # Geometry: each output pixel takes its source pixel's value (nearest), 0 outside the image.
    a = tables["affine"][row][:, :, None]  # (N, 6, 1)
    ys, xs = torch.meshgrid(torch.arange(height, device=x.device), torch.arange(width, device=x.device),
                            indexing="ij")
    xs, ys = xs.reshape(1, -1), ys.reshape(1, -1)
    sx = (a[:, 0] * xs + a[:, 1] * ys + a[:, 2] + ONE // 2) >> 16
    sy = (a[:, 3] * xs + a[:, 4] * ys + a[:, 5] + ONE // 2) >> 16
    inside = ((sx >= 0) & (sx < width) & (sy >= 0) & (sy < height))[:, None, :]
    source = (sy.clamp(0, height - 1) * width + sx.clamp(0, width - 1))[:, None, :].expand(n, c, -1)
    x = (x.flatten(2).gather(2, source) * inside).view(n, c, height, width)
    # Colour: blend with a degenerate image (black, grey, the mean grey, a blur) by factor/256.
    xi = x.int()
    gray = (xi if c != 3 else (2989 * xi[:, 0:1] + 5870 * xi[:, 1:2] + 1140 * xi[:, 2:3]) // 10000)
    area = gray.shape[1] * height * width  # the grey image's, or each channel's for 2 or 4 channels
    mean = (2 * gray.sum((1, 2, 3), keepdim=True) + area) // (2 * area)
    padded = torch.nn.functional.pad(xi, (1, 1, 1, 1))
    around = sum(padded[:, :, dy:dy + height, dx:dx + width] for dy in range(3) for dx in range(3))
    blur = xi.clone()  # torchvision's 3x3 smoothing (centre weight 5 of 13), the border kept
    blur[:, :, 1:-1, 1:-1] = ((around + 4 * xi) * 2 + 13)[:, :, 1:-1, 1:-1] // 26
    name = [t[0] for t in TA_WIDE]
    pick = lambda k: (op == name.index(k)).view(-1, 1, 1, 1)  # noqa: E731
    degenerate = torch.where(pick("color"), gray, torch.where(pick("contrast"), mean, torch.where(
        pick("sharpness"), blur, torch.zeros_like(xi))))
    q = tables["factor"][row].view(-1, 1, 1, 1).int()
    xi = ((xi * q + degenerate * (256 - q) + 128) >> 8).clamp(0, 255)
    xi = xi & tables["mask"][row].view(-1, 1, 1, 1).int()
    xi = torch.where(xi >= tables["threshold"][row].view(-1, 1, 1, 1).int(), 255 - xi, xi)
    low, high = xi.amin((2, 3), keepdim=True), xi.amax((2, 3), keepdim=True)
    stretched = torch.where(high > low, (xi - low) * 255 // (high - low).clamp(min=1), xi)
    xi = torch.where(pick("autocontrast"), stretched, xi)
    x = xi.to(torch.uint8)
    import torchvision.transforms.v2.functional as TF  # here: torchvision's import costs every process a second
    return torch.where(pick("equalize"), TF.equalize(x), x)


def _erase_table(height: int, width: int) -> torch.Tensor:
    """The erased box's (height, width) for 256 x 256 levels of area fraction and log aspect ratio."""
    area, sizes = height * width, []
    for i in range(256):
        for j in range(256):
            s = ERASE_SCALE[0] + (ERASE_SCALE[1] - ERASE_SCALE[0]) * (i + 0.5) / 256
            r = math.exp(math.log(ERASE_RATIO[0])
                         + math.log(ERASE_RATIO[1] / ERASE_RATIO[0]) * (j + 0.5) / 256)
            sizes.append([min(height, max(1, round(math.sqrt(s * area * r)))),
                          min(width, max(1, round(math.sqrt(s * area / r))))])
    return torch.tensor(sizes, dtype=torch.int64)


def random_erase(x: torch.Tensor, h: torch.Tensor, tables: dict, p: float) -> torch.Tensor:
    """With probability p per image, one box of the uint8 batch x set to the fill colour; drawn from h."""
    n, c, height, width = x.shape
    erase = _bits(h, 0, 16) < round(p * 65536)
    size = tables["erase"][_bits(h, 16, 16)]  # (N, 2)
    eh, ew = size[:, 0], size[:, 1]
    y0, x0 = _bits(h, 32, 12) % (height - eh + 1), _bits(h, 44, 12) % (width - ew + 1)
    rows = torch.arange(height, device=x.device)[None, :]
    cols = torch.arange(width, device=x.device)[None, :]
    in_rows = (rows >= y0[:, None]) & (rows < (y0 + eh)[:, None])
    in_cols = (cols >= x0[:, None]) & (cols < (x0 + ew)[:, None])
    box = (erase[:, None, None] & in_rows[:, :, None] & in_cols[:, None, :])[:, None]
    return torch.where(box, tables["fill"], x)


# ------------------------------------------------------------------ per micro-batch: mixup and cutmix

class Mix:
    """Mixup (Zhang et al. 2018) and cutmix (Yun et al. 2019) within each micro-batch, as torchvision's
    references do per batch: each image with the next one (a roll by one), at a ratio lam ~ Beta(alpha,
    alpha), one of the two at random when both alphas are set. The targets become soft: lam of the image's
    class and 1 - lam of its partner's (label smoothing, in the loss, applies on top). Drawn from (seed,
    epoch, the step's first position in the epoch's order, the micro-batch's virtual rank r + k x W): the
    micro-batches are those of W x A ranks (EpochSampler), so is their mixing. Mixup's lam is kept to
    1/256 steps, and the pixels mixed in integers."""

    def __init__(self, *, mixup_alpha: float, cutmix_alpha: float, num_classes: int, seed: int, rank: int,
                 world_size: int):
        self.mixup_alpha, self.cutmix_alpha, self.num_classes = mixup_alpha, cutmix_alpha, num_classes
        self.seed, self.rank, self.world_size = seed, rank, world_size

    @property
    def active(self) -> bool:
        return bool(self.mixup_alpha or self.cutmix_alpha)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, *, epoch: int, position: int,
                 micro_sizes: list) -> tuple:
        """A step's uint8 images and class labels on this rank (its micro-batches back to back) -> mixed
        images, soft targets (N, classes) float32."""
        if not self.active:
            return images, labels
        targets = torch.nn.functional.one_hot(labels, self.num_classes).float()
        out_images, out_targets, start = [], [], 0
        for k, size in enumerate(micro_sizes):
            x, t = images[start:start + size], targets[start:start + size]
            start += size
            if size:
                key = mix64(self.seed, epoch, position + self.rank + k * self.world_size)
                x, t = self.mix_one(x, t, np.random.default_rng([key, _SALT_MIX]))
            out_images.append(x)
            out_targets.append(t)
        return torch.cat(out_images), torch.cat(out_targets)

    def mix_step(self, loader, step: int, images: torch.Tensor, labels: torch.Tensor) -> tuple:
        """The training loader's `step`-th batch of this pass, mixed within each micro-batch (the loader's
        step_split: unread samples left out), with soft targets."""
        sampler = loader.batch_sampler
        position = sampler.start + step * sampler.batch_size  # where the step starts in the epoch's order
        _, micro_sizes = loader.step_split(position)
        return self(images, labels, epoch=sampler.epoch, position=position, micro_sizes=micro_sizes)

    def mix_one(self, x: torch.Tensor, t: torch.Tensor, rng) -> tuple:
        cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < 0.5)
        lam = float(rng.beta(*[self.cutmix_alpha if cutmix else self.mixup_alpha] * 2))
        other = x.roll(1, 0)
        if cutmix:  # a box of about 1 - lam of the image from the partner; lam then its true share
            height, width = x.shape[-2:]
            cut = math.sqrt(1.0 - lam)
            cy, cx = int(rng.integers(height)), int(rng.integers(width))
            y0, y1 = max(cy - int(height * cut) // 2, 0), min(cy + int(height * cut) // 2, height)
            x0, x1 = max(cx - int(width * cut) // 2, 0), min(cx + int(width * cut) // 2, width)
            x = x.clone()
            x[..., y0:y1, x0:x1] = other[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (height * width)
        else:
            q = round(lam * 256)
            x = ((x.int() * q + other.int() * (256 - q) + 128) >> 8).to(torch.uint8)
            lam = q / 256
        return x, t * lam + t.roll(1, 0) * (1.0 - lam)
