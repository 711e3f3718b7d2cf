"""The training augmentation (random crop with zero padding, horizontal flip, keyed on (seed, epoch,
index)): every view reached uniformly, deterministic per key, the per-image path (CPU workers) equal
to the batched one (device loader) for any image shape, and normalisation equal to torchvision's."""
import collections

import pytest
import torch

import dataset_utils as du
import transforms


def test_augmentation_reaches_all_81_crops_and_2_flips_uniformly():
    # An image whose pixels are all distinct, so each output reveals its crop offset and flip.
    g = torch.Generator().manual_seed(0)
    img = torch.randint(1, 256, (1, 3, 32, 32), generator=g, dtype=torch.uint8)
    ds = du.ImageDataset(du.ImageData(img, torch.zeros(1, dtype=torch.int64)), augment=True, seed=7)
    padded = torch.nn.functional.pad(img[0], (4, 4, 4, 4))
    views = {}
    for dy in range(9):
        for dx in range(9):
            crop = padded[:, dy:dy + 32, dx:dx + 32]
            views[crop.numpy().tobytes()] = (dy, dx, 0)
            views[crop.flip(-1).numpy().tobytes()] = (dy, dx, 1)
    assert len(views) == 162
    n = 162 * 100
    counts = collections.Counter(views[ds[(epoch, 0)][0].numpy().tobytes()] for epoch in range(n))
    assert len(counts) == 162
    chi2 = sum((c - 100) ** 2 / 100 for c in counts.values())
    assert chi2 < 230  # chi-square, 161 degrees of freedom: p ~ 0.0003
    # Deterministic: the same key gives the same view, and other seeds give other views.
    assert torch.equal(ds[(5, 0)][0], ds[(5, 0)][0])
    other = du.ImageDataset(du.ImageData(img, torch.zeros(1, dtype=torch.int64)), augment=True, seed=8)
    assert any(not torch.equal(ds[(e, 0)][0], other[(e, 0)][0]) for e in range(10))


def test_normalize_matches_the_torchvision_transform():
    from torchvision.transforms import v2
    x = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    ours = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, torch.device("cpu"))(x)
    ref = v2.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD)(x.float() / 255)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_hash_is_the_same_on_ints_and_tensors():
    import random
    rng = random.Random(0)
    keys = [(rng.randrange(1 << 31), rng.randrange(1000), rng.randrange(10 ** 6)) for _ in range(500)]
    ints = [du.mix64(s, e, i) for s, e, i in keys]
    tensors = [du.mix64(s, e, torch.tensor([i]))[0].item() for s, e, i in keys]
    assert [h - (1 << 64) if h >> 63 else h for h in ints] == tensors
    assert [transforms.crop_params(h, (4, 4)) for h in ints] == [
        tuple(int(v) for v in transforms.crop_params(torch.tensor([t]), (4, 4))) for t in tensors]


def test_batched_device_augmentation_reaches_all_162_views_uniformly():
    g = torch.Generator().manual_seed(1)
    img = torch.randint(1, 256, (1, 3, 32, 32), generator=g, dtype=torch.uint8)
    padded = torch.nn.functional.pad(img, (4, 4, 4, 4))
    views = {}
    for dy in range(9):
        for dx in range(9):
            crop = padded[0, :, dy:dy + 32, dx:dx + 32]
            views[crop.numpy().tobytes()] = (dy, dx, 0)
            views[crop.flip(-1).numpy().tobytes()] = (dy, dx, 1)
    n = 162 * 100
    idx = torch.zeros(n, dtype=torch.int64)
    # n different keys, one image
    out = du.crop_flip_batch(padded, idx, du.mix64(7, 3, torch.arange(n)), (4, 4))
    counts = collections.Counter(views[x.numpy().tobytes()] for x in out)
    assert len(counts) == 162
    assert sum((c - 100) ** 2 / 100 for c in counts.values()) < 230


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 24, 40), (2, 9, 13), (3, 5, 5)])
def test_augmentation_scales_with_the_image_and_both_paths_cut_the_same_pixels(shape):
    """Zero padding of an eighth of each side (at least 1), every crop offset and flip reached, and the
    per-image crop (CPU workers) equal to the batched one (device loader) for every key."""
    c, h, w = shape
    pad = du.crop_padding(h, w)
    assert pad == (max(1, h // 8), max(1, w // 8))
    g = torch.Generator().manual_seed(2)
    img = torch.randint(1, 256, (1, c, h, w), generator=g, dtype=torch.uint8)
    padded = torch.nn.functional.pad(img[0], (pad[1], pad[1], pad[0], pad[0]))
    views = {}
    for dy in range(2 * pad[0] + 1):
        for dx in range(2 * pad[1] + 1):
            crop = padded[:, dy:dy + h, dx:dx + w]
            views[crop.numpy().tobytes()] = (dy, dx, 0)
            views[crop.flip(-1).numpy().tobytes()] = (dy, dx, 1)
    n = len(views) * 30
    data = du.ImageData(img.expand(n, c, h, w).clone(), torch.zeros(n, dtype=torch.int64))
    dataset = du.ImageDataset(data, augment=True, seed=3)
    one_by_one = torch.stack([dataset[(5, i)][0] for i in range(n)])
    batched = du.crop_flip_batch(du.pad_images(data.images, pad), torch.arange(n),
                                 du.mix64(3, 5, torch.arange(n)), pad)
    assert one_by_one.shape == batched.shape == (n, c, h, w) and torch.equal(one_by_one, batched)
    counts = collections.Counter(views[x.numpy().tobytes()] for x in batched)
    assert len(counts) == len(views) and min(counts.values()) >= 10  # all reached, none starved (mean 30)



