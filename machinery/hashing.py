"""The seeds of the augmentation's random draws: splitmix64 of (seed, epoch, index) (mix64), and seeded(), which runs
a transform with torch's generator seeded so."""
import torch

_M64 = (1 << 64) - 1
_C0, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64


def signed(c: int) -> int:
    return c - (1 << 64) if c >> 63 else c


def mix64(seed: int, epoch: int, idx):
    """A 64-bit hash giving each sample its own crop and flip. `idx` is a Python int (CPU workers) or an int64
    tensor (device loader): both give the same bits, so both loaders augment every sample identically."""
    if isinstance(idx, torch.Tensor):  # int64 wraps like uint64; mask arithmetic shifts into logical ones
        mul = lambda h, c: h * signed(c)  # noqa: E731
        shr = lambda h, s: (h >> s) & ((1 << (64 - s)) - 1)  # noqa: E731
        h = torch.full_like(idx, signed(_C0))
    else:
        mul = lambda h, c: (h * c) & _M64  # noqa: E731
        shr = lambda h, s: h >> s  # noqa: E731
        h = _C0
    for k in (seed, epoch, idx):
        h = mul(h ^ k, _C1)
        h = mul(h ^ shr(h, 31), _C2)
        h = h ^ shr(h, 29)
    return h


def seeded(transform, inputs, seed: int):
    """transform(*inputs) drawing from torch's default generator seeded with `seed`, its state put back after: the
    draws depend on the seed alone, and the training's own (dropout) are untouched."""
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed % (1 << 64))  # the hash, signed (a tensor's) or not, as one unsigned seed
    try:
        return transform(*inputs)
    finally:
        generator.set_state(state)
