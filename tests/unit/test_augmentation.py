"""The training augmentation: the default transform (torchvision's RandomCrop with zero padding of an eighth of each
side, then RandomHorizontalFlip, each image seeded from (seed, epoch, index)) and the device loader's batched crop and
flip each reach every view uniformly for any image shape; a transform's output is checked before the first step;
normalisation equals torchvision's."""
import argparse
import collections
import inspect

import pytest
import torch

import dataset_utils as du
import train_ddp
from machinery.errors import UserError
from machinery.transform_checks import check_transforms
from dataset_utils import CropFlip, crop_padding

FLAGS = argparse.Namespace(auto_augment=None, random_erase=0.0, mixup_alpha=0.0, cutmix_alpha=0.0)


def default_dataset(images, seed):
    data = du.ImageData(images, torch.zeros(len(images), dtype=torch.int64))
    spec = du.DataSpec(*images.shape[1:], num_classes=1, mean=(0.5,) * images.shape[1], std=(0.25,) * images.shape[1])
    return du.ImageDataset(data, transform=train_ddp.build_transforms(FLAGS, spec)[0], seed=seed)


def views_of(img, pad):
    """Every zero-padded crop of `img` (C, H, W) back to its size, and its mirror: {bytes: (dy, dx, flip)}."""
    c, h, w = img.shape
    padded = torch.nn.functional.pad(img, (pad[1], pad[1], pad[0], pad[0]))
    views = {}
    for dy in range(2 * pad[0] + 1):
        for dx in range(2 * pad[1] + 1):
            crop = padded[:, dy:dy + h, dx:dx + w]
            views[crop.numpy().tobytes()] = (dy, dx, 0)
            views[crop.flip(-1).numpy().tobytes()] = (dy, dx, 1)
    return views


def test_the_default_transform_reaches_all_81_crops_and_2_flips_uniformly_and_each_key_draws_alike():
    # An image whose pixels are all distinct, so each output reveals its crop offset and flip.
    g = torch.Generator().manual_seed(0)
    img = torch.randint(1, 256, (1, 3, 32, 32), generator=g, dtype=torch.uint8)
    ds = default_dataset(img, seed=7)
    views = views_of(img[0], (4, 4))
    assert len(views) == 162
    n = 162 * 100
    counts = collections.Counter(views[ds[(epoch, 0)][0].numpy().tobytes()] for epoch in range(n))
    assert len(counts) == 162
    chi2 = sum((c - 100) ** 2 / 100 for c in counts.values())
    assert chi2 < 230  # chi-square, 161 degrees of freedom: p ~ 0.0003
    # Deterministic: the same key gives the same view, and other seeds give other views.
    assert torch.equal(ds[(5, 0)][0], ds[(5, 0)][0])
    other = default_dataset(img, seed=8)
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
def test_the_default_augmentation_scales_with_the_image_on_both_loaders(shape):
    """Zero padding of an eighth of each side (at least 1); the per-image transform (DataLoader workers) and the
    batched crop and flip (device loader), which build_transforms marks it for (CropFlip), each reach every crop
    offset and flip."""
    c, h, w = shape
    pad = crop_padding(h, w)
    assert pad == (max(1, h // 8), max(1, w // 8))
    g = torch.Generator().manual_seed(2)
    img = torch.randint(1, 256, (1, c, h, w), generator=g, dtype=torch.uint8)
    views = views_of(img[0], pad)
    n = len(views) * 20
    dataset = default_dataset(img.expand(n, c, h, w).clone(), seed=3)
    assert isinstance(dataset.transform, CropFlip) and dataset.transform.size == shape[1:]
    one_by_one = torch.stack([dataset[(5, i)][0] for i in range(n)])
    padded = torch.nn.functional.pad(img.expand(n, c, h, w), (pad[1], pad[1], pad[0], pad[0]))
    batched = du.crop_flip_batch(padded, torch.arange(n), du.mix64(3, 5, torch.arange(n)), pad)
    for out in (one_by_one, batched):
        assert out.shape == (n, c, h, w)
        counts = collections.Counter(views[x.numpy().tobytes()] for x in out)
        assert len(counts) == len(views) and min(counts.values()) >= 4  # all reached, none starved (mean 20)


def check(train, test, train_images=None, test_images=None):
    images = torch.randint(0, 256, (4, 3, 36, 36), dtype=torch.uint8)
    labels = torch.zeros(4, dtype=torch.int64)
    data = argparse.Namespace(train=du.ImageData(images if train_images is None else train_images, labels),
                              test=du.ImageData(images if test_images is None else test_images, labels))
    return check_transforms(data, train, test)


def test_a_transform_s_output_is_checked_before_the_first_step_in_one_line_naming_it():
    from torchvision.transforms import v2
    crop = v2.Compose([v2.RandomResizedCrop(32, scale=(0.5, 1)), v2.RandomHorizontalFlip()])
    assert check(crop, v2.CenterCrop(32)) == (3, 32, 32)
    cases = [(v2.Compose([crop, v2.ToPILImage()]), None, "the training transform (build_transforms in train_ddp.py) "
              "returned a PIL.Image.Image for a 3 x 36 x 36 uint8 image"),
             (v2.Compose([crop, v2.ToDtype(torch.float32, scale=True)]), None, "returned a 3 x 32 x 32 float32 tensor"),
             (v2.Compose([crop, v2.Grayscale()]), None, "returned a 1 x 32 x 32 uint8 tensor"),
             (crop, None, "gives images of 3 x 32 x 32 but the test images (no test transform) of 3 x 36 x 36"),
             (crop, v2.CenterCrop(30), "but the test transform (build_transforms in train_ddp.py) of 3 x 30 x 30")]
    for train, test, says in cases:
        with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")):
            check(train, test)


def test_a_transform_that_draws_from_elsewhere_than_torch_s_generator_is_named_at_start(capsys):
    import random

    class PythonRandomFlip(torch.nn.Module):
        rng = random.Random(0)  # Python's generator, seeded here: the same draws whatever ran before

        def forward(self, image):
            return image.flip(-1) if self.rng.random() < 0.5 else image

    check(PythonRandomFlip(), None)
    assert capsys.readouterr().out.count("note: the training transform gave two outputs for one seed") == 1
    from torchvision.transforms import v2
    check(v2.RandomHorizontalFlip(), None)
    assert "two outputs" not in capsys.readouterr().out


def test_build_transforms_batches_only_its_own_default_and_never_an_adapter_s_pipeline_of_two_ops():
    """build_transforms returns the default crop and flip as a CropFlip (the device loader batches it on the GPU);
    any other list, even of two ops as ADAPT (3/6)'s example for photos, runs as written, per image."""
    spec = du.DataSpec(3, 32, 32, num_classes=10, mean=(0.5,) * 3, std=(0.25,) * 3)
    cfg = argparse.Namespace(auto_augment=None, random_erase=0.0, mixup_alpha=0.0, cutmix_alpha=0.0)
    assert isinstance(train_ddp.build_transforms(cfg, spec)[0], CropFlip)
    for option in ({"auto_augment": "ta_wide"}, {"random_erase": 0.5}):
        assert not isinstance(train_ddp.build_transforms(argparse.Namespace(**{**vars(cfg), **option}), spec)[0],
                              CropFlip)
    source = inspect.getsource(train_ddp.build_transforms)
    adapted = source.replace("train = [*crop_flip]", "train = [v2.RandomResizedCrop((data.height, data.width)), "
                             "v2.RandomHorizontalFlip()]")
    assert adapted != source
    namespace = dict(vars(train_ddp))
    exec(adapted, namespace)  # build_transforms as an adapter edits it
    train, _, _ = namespace["build_transforms"](cfg, spec)
    assert not isinstance(train, CropFlip) and type(train.transforms[0]).__name__ == "RandomResizedCrop"
