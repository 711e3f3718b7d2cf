"""The real CIFAR-100 loading code on generated archives in the official format, and the loaders."""
import collections
import os
import pickle

import pytest
import torch

import dataset_utils as du
from conftest import index_images, write_cifar100
from train_utils import UserError


def test_reads_a_generated_archive_in_the_official_format(tmp_path, monkeypatch):
    md5 = write_cifar100(str(tmp_path), 250, 120, seed=3)
    # Read back what was written, independently of the code under test.
    write_cifar100(str(tmp_path / "ref"), 250, 120, seed=3, archive=False)
    monkeypatch.setattr(du, "CIFAR100_MD5", md5)  # the generated archive's md5 stands in for the real one
    du.prepare_cifar100(str(tmp_path))
    assert sorted(os.listdir(tmp_path / "cifar-100-python")) == ["meta", "test", "train"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary leftovers
    for split, n in (("train", 250), ("test", 120)):
        data = du.read_cifar100(str(tmp_path), split == "train")
        with open(tmp_path / "ref" / "cifar-100-python" / split, "rb") as f:
            ref = pickle.load(f, encoding="latin1")
        assert data.images.dtype == torch.uint8 and data.images.shape == (n, 3, 32, 32)
        assert data.labels.dtype == torch.int64 and data.labels.tolist() == ref["fine_labels"]
        assert torch.equal(data.images.reshape(n, -1), torch.from_numpy(ref["data"]))
    # A second call finds the extracted files and does nothing.
    du.prepare_cifar100(str(tmp_path))


def test_synthetic_has_the_shapes_and_dtypes_of_cifar100(tmp_path):
    write_cifar100(str(tmp_path), 100, 50, archive=False)
    for train in (True, False):
        real = du.load_split("cifar100", str(tmp_path), train)
        fake = du.load_split("synthetic", str(tmp_path), train, size=len(real.labels))
        assert fake.images.dtype == real.images.dtype == torch.uint8
        assert fake.images.shape == real.images.shape
        assert fake.labels.dtype == real.labels.dtype == torch.int64
        assert 0 <= int(fake.labels.min()) and int(fake.labels.max()) < 100
    assert len(du.load_split("synthetic", "", True).labels) == 50_000
    assert len(du.load_split("synthetic", "", False).labels) == 10_000


def test_train_and_test_size_take_the_first_samples(tmp_path):
    write_cifar100(str(tmp_path), 100, 50, archive=False)
    full = du.load_split("cifar100", str(tmp_path), True)
    part = du.load_split("cifar100", str(tmp_path), True, size=30)
    assert torch.equal(part.images, full.images[:30]) and torch.equal(part.labels, full.labels[:30])
    with pytest.raises(UserError, match="--train-size 101 exceeds the 100 train samples"):
        du.load_split("cifar100", str(tmp_path), True, size=101)


def test_corrupt_archive_is_refused_before_extraction(tmp_path):
    write_cifar100(str(tmp_path), 20, 10)
    archive = tmp_path / "cifar-100-python.tar.gz"
    with pytest.raises(UserError, match="fails its md5 check.*delete it"):
        du.prepare_cifar100(str(tmp_path))
    assert not (tmp_path / "cifar-100-python").exists()
    assert archive.exists()  # the user's file is left for them to inspect


def test_missing_data_offline_names_the_directory_and_the_archive(tmp_path, monkeypatch):
    monkeypatch.setattr(du, "CIFAR100_URL", "http://127.0.0.1:9/cifar-100-python.tar.gz")
    with pytest.raises(UserError) as e:
        du.prepare_cifar100(str(tmp_path / "data"))
    msg = str(e.value)
    assert str(tmp_path / "data") in msg and "cifar-100-python.tar.gz" in msg and "\n" not in msg
    assert os.listdir(tmp_path / "data") == []  # no partial download left behind


def test_pickles_holding_code_are_refused(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (folder / "train").write_bytes(pickle.dumps({"data": Evil(), "fine_labels": []}))
    with pytest.raises(UserError, match="unexpected object"):
        du.read_cifar100(str(tmp_path), train=True)
    (folder / "test").write_bytes(b"truncated")
    with pytest.raises(UserError, match="is unreadable"):
        du.read_cifar100(str(tmp_path), train=False)


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


@pytest.mark.quick
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_test_shards_cover_every_image_exactly_once(world_size):
    data = du.ImageData(torch.from_numpy(index_images(301)), torch.arange(301))
    seen = []
    for rank in range(world_size):
        _, test_loader = du.build_loaders(data, data, 16 * world_size, rank, world_size, 1, 16, seed=0, workers=0,
                                          pin_memory=False)
        for images, labels in test_loader:
            seen += (images[:, 0, 16, 16].long() + 256 * images[:, 1, 16, 16].long()).tolist()
    assert sorted(seen) == list(range(301))


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
    assert [du.crop_params(h, (4, 4)) for h in ints] == [tuple(int(v) for v in du.crop_params(torch.tensor([t]), (4, 4)))
                                                  for t in tensors]


@pytest.mark.parametrize("world_size,accum,start", [(1, 1, 0), (3, 1, 0), (2, 1, 64), (3, 1, 96), (2, 2, 64)])
def test_gpu_and_torch_loaders_yield_identical_batches(world_size, accum, start):
    g = torch.Generator().manual_seed(0)
    data = du.ImageData(torch.randint(0, 256, (300, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(300))
    for rank in range(world_size):
        batch = 32 * world_size
        torch_train, torch_test = du.build_loaders(data, data, batch, rank, world_size, accum, 32, 5, 0, False)
        dev_train, dev_test = du.build_loaders(data, data, batch, rank, world_size, accum, 32, 5, 0, False,
                                               device=torch.device("cpu"))
        for epoch in (1, 2):
            torch_train.batch_sampler.set_epoch(epoch, start=start)
            dev_train.batch_sampler.set_epoch(epoch, start=start)
            a, b = list(torch_train), list(dev_train)
            assert len(a) == len(b) == len(dev_train) == len(torch_train)
            for (xa, ya), (xb, yb) in zip(a, b):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(torch_test, dev_test))


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
    out = du.crop_flip_batch(padded, idx, du.mix64(7, 3, torch.arange(n)), (4, 4))  # n different keys, one image
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
    batched = du.crop_flip_batch(du.pad_images(data.images, pad), torch.arange(n), du.mix64(3, 5, torch.arange(n)), pad)
    assert one_by_one.shape == batched.shape == (n, c, h, w) and torch.equal(one_by_one, batched)
    counts = collections.Counter(views[x.numpy().tobytes()] for x in batched)
    assert len(counts) == len(views) and min(counts.values()) >= 10  # all reached, none starved (mean 30)


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 24, 40)])
def test_both_loaders_yield_identical_batches_for_any_image_shape(shape):
    g = torch.Generator().manual_seed(0)
    data = du.ImageData(torch.randint(0, 256, (150, *shape), dtype=torch.uint8, generator=g), torch.arange(150))
    for rank in range(2):
        torch_train, torch_test = du.build_loaders(data, data, 32, rank, 2, 1, 16, 5, 0, False)
        dev_train, dev_test = du.build_loaders(data, data, 32, rank, 2, 1, 16, 5, 0, False, device=torch.device("cpu"))
        torch_train.batch_sampler.set_epoch(1, start=64)
        dev_train.batch_sampler.set_epoch(1, start=64)
        a, b = list(torch_train), list(dev_train)
        assert len(a) == len(b) == 3 and all(x.shape[1:] == shape for x, _ in a)
        assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
        assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(torch_test, dev_test))


def test_describe_data_takes_shape_classes_and_statistics_from_the_data():
    images = torch.tensor([[[[0, 255]]], [[[51, 102]]]], dtype=torch.uint8)  # 2 images, 1 x 1 x 2
    train = du.ImageData(images, torch.tensor([0, 3]))
    test = du.ImageData(images[:1], torch.tensor([4]))
    spec = du.describe_data(train, test)
    pixels = torch.tensor([0, 255, 51, 102], dtype=torch.float64) / 255
    assert (spec.channels, spec.height, spec.width, spec.num_classes) == (1, 1, 2, 5)  # the largest label of either + 1
    assert spec.mean == pytest.approx((pixels.mean().item(),), abs=1e-12)
    assert spec.std == pytest.approx((pixels.std(unbiased=False).item(),), abs=1e-12)
    # What a split states is taken as stated.
    stated = du.ImageData(images, torch.tensor([0, 3]), num_classes=10, mean=(0.5,), std=(0.25,))
    assert du.describe_data(stated, test) == du.DataSpec(1, 1, 2, 10, (0.5,), (0.25,))
    # A constant channel keeps its scale (std 1) rather than dividing by zero.
    flat = du.ImageData(torch.full((2, 1, 2, 2), 7, dtype=torch.uint8), torch.tensor([0, 1]))
    assert du.describe_data(flat, flat).std == (1.0,)


class Files(list):
    """A Dataset that lists its classes, as torchvision's ImageFolder does, but states no statistics."""
    classes = ["a", "b"]


@pytest.mark.parametrize("train,test,says", [
    (du.ImageData(torch.zeros(2, 1, 4, 4), torch.tensor([0, 1])), None, "needs uint8 images (N, C, H, W)"),
    (du.ImageData(torch.zeros(2, 4, 4, dtype=torch.uint8), torch.tensor([0, 1])), None, "needs uint8 images"),
    (du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1], dtype=torch.int32)), None,
     "int64 labels (N,)"),
    (du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1])),
     du.ImageData(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([0, 1])), "training images of 1 x 4 x 4 but test"),
    (du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1]), num_classes=2),
     du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 2])), "test labels span [0, 2], outside [0, 2)"),
    (du.ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([-1, 1])), None, "training labels span [-1, 1]"),
    ([(torch.zeros(1, 4, 4, dtype=torch.uint8), 0)], None, "states no number of classes: set its .num_classes"),
    (Files([(torch.zeros(1, 4, 4, dtype=torch.uint8), 0)]), None, "states no per-channel mean and std"),
    ([(torch.zeros(4, 4, 1).numpy(), 0)], None, "it must yield (uint8 tensor C x H x W, integer label)"),
    ([(torch.zeros(1, 4, 4, dtype=torch.uint8), torch.tensor(1.0))], None, "it must yield (uint8 tensor C x H x W, integer"),
    (42, None, "return dataset_utils.ImageData, or a Dataset"),
])
def test_describe_data_refuses_what_the_loaders_cannot_take_in_one_line(train, test, says):
    with pytest.raises(UserError) as e:
        du.describe_data(train, test if test is not None else train)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_dataset_s_integer_labels_of_any_kind_reach_the_loss_as_int64():
    """torch.int32 and numpy integers from a user's Dataset: collated as int64, as cross_entropy needs."""
    import numpy as np
    items = Files([(torch.full((1, 8, 8), i, dtype=torch.uint8), label) for i, label in
                   enumerate([torch.tensor(0, dtype=torch.int32), np.int64(1), 1, torch.tensor(0)])])
    items.mean, items.std = (0.5,), (0.25,)
    assert du.describe_data(items, items).num_classes == 2
    train, test = du.build_loaders(items, items, 4, 0, 1, 1, 4, 0, 0, False)
    train.batch_sampler.set_epoch(1)
    for loader in (train, test):
        (images, labels), = list(loader)
        assert images.shape == (4, 1, 8, 8) and labels.dtype == torch.int64
