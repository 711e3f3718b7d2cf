"""The augmentation's seeds, splitmix64 of (seed, epoch, index), and seeded()."""
import torch

_C0, _C1, _C2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))  # as int64


def mix64(seed: int, epoch: int, idx):
    """A 64-bit hash per sample: the same bits for an int `idx` (CPU workers) and an int64 tensor."""
    # int64 wraps like uint64 (constants signed, shifts masked); ints masked to 64 bits
    h, bits = (torch.full_like(idx, _C0), -1) if isinstance(idx, torch.Tensor) else (_C0 % (1 << 64), (1 << 64) - 1)
    for k in (seed, epoch, idx):
        h = ((h ^ k) * _C1) & bits
        h = ((h ^ ((h >> 31) & ((1 << 33) - 1))) * _C2) & bits
        h = h ^ ((h >> 29) & ((1 << 35) - 1))
    return h


def seeded(transform, inputs, seed: int):
    """transform(*inputs) on torch's generator seeded with `seed`, its state restored after."""
    with torch.random.fork_rng(devices=()):
        torch.default_generator.manual_seed(seed % (1 << 64))  # signed or not, one unsigned seed
        return transform(*inputs)
