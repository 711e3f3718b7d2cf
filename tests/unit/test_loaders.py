"""The loaders (dataset_utils.build_loaders): the test shards score every image exactly once for any
world size, as stored (no augmentation); the device-resident loader yields the DataLoader's batches bit for
bit (any world size, accumulation, resume position and image shape); a Dataset's integer labels reach the loss
as int64; the workers' socket fits in the temporary folder's path, or the run is refused; the workers are forked
with torch already imported."""
import pytest
import torch

import dataset_utils as du
import support
from machinery import loader_workers
from support import index_images, loaders_both_ways


class Files(list):
    """A Dataset that lists its classes, as torchvision's ImageFolder does, but states no statistics."""
    classes = ["a", "b"]


@pytest.mark.quick
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_test_shards_cover_every_image_exactly_once(world_size):
    data = du.ImageData(torch.from_numpy(index_images(301)), torch.arange(301))
    seen = []
    for rank in range(world_size):
        _, test_loader = support.build_loaders(data, data, batch_size=16 * world_size, rank=rank,
                                               world_size=world_size, accum_steps=1, eval_batch=16, seed=0,
                                               workers=0, pin_memory=False)
        for images, labels in test_loader:
            seen += (images[:, 0, 16, 16].long() + 256 * images[:, 1, 16, 16].long()).tolist()
    assert sorted(seen) == list(range(301))


@pytest.mark.parametrize("device", [None, torch.device("cpu")], ids=["DataLoader", "device loader"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_the_test_loader_yields_the_stored_images_without_augmentation(device, world_size):
    """Rank r's test batches are its shard (images r, r + world_size, ...) exactly as stored: no crop, no
    flip, whatever the epoch; the training loader of the same data does augment (the control)."""
    g = torch.Generator().manual_seed(4)
    data = du.ImageData(torch.randint(0, 256, (101, 3, 32, 32), dtype=torch.uint8, generator=g),
                        torch.arange(101))
    for rank in range(world_size):
        train, test = support.build_loaders(data, data, batch_size=8 * world_size, rank=rank,
                                            world_size=world_size, accum_steps=1, eval_batch=8, seed=0,
                                            workers=0, pin_memory=False, device=device)
        for epoch in (1, 2):
            train.batch_sampler.set_epoch(epoch)
            images, labels = (torch.cat(parts) for parts in zip(*test))
            assert torch.equal(labels, torch.arange(rank, 101, world_size))
            assert torch.equal(images, data.images[rank::world_size])
        x, y = next(iter(train))
        assert not torch.equal(x, data.images[y]), "the training batches are augmented"


@pytest.mark.parametrize("world_size,accum,start", [(1, 1, 0), (3, 1, 0), (2, 1, 64), (3, 1, 96), (2, 2, 64)])
def test_gpu_and_torch_loaders_yield_the_same_samples_and_per_image_transforms_the_same_pixels(world_size, accum,
                                                                                                start):
    """The same samples in the same order on both loaders; with a per-image transform (random erasing here) the
    same pixels too, the device loader seeding each image as the workers do. The default crop and flip, batched on
    the device, draws its own views (test_augmentation.py)."""
    g = torch.Generator().manual_seed(0)
    data = du.ImageData(torch.randint(0, 256, (300, 3, 32, 32), dtype=torch.uint8, generator=g),
                        torch.arange(300))
    for rank in range(world_size):
        batch = 32 * world_size
        for augment, same_pixels in (({}, False), ({"random_erase": 0.5}, True)):
            common = dict(batch_size=batch, rank=rank, world_size=world_size, accum_steps=accum, eval_batch=32,
                          seed=5, workers=0, pin_memory=False, augment=augment)
            torch_train, torch_test = support.build_loaders(data, data, **common)
            dev_train, dev_test = support.build_loaders(data, data, **common, device=torch.device("cpu"))
            for epoch in (1, 2):
                for sampler in (torch_train.batch_sampler, dev_train.batch_sampler):
                    sampler.set_epoch(epoch)
                    sampler.start_at(start)
                a, b = list(torch_train), list(dev_train)
                assert len(a) == len(b) == len(dev_train) == len(torch_train)
                for (xa, ya), (xb, yb) in zip(a, b):
                    assert torch.equal(ya, yb) and xa.shape == xb.shape
                    assert torch.equal(xa, xb) == same_pixels
            assert all(torch.equal(xa, xb) and torch.equal(ya, yb)
                       for (xa, ya), (xb, yb) in zip(torch_test, dev_test))


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 24, 40)])
def test_both_loaders_yield_the_same_samples_for_any_image_shape(shape):
    g = torch.Generator().manual_seed(0)
    data = du.ImageData(torch.randint(0, 256, (150, *shape), dtype=torch.uint8, generator=g),
                        torch.arange(150))
    for rank in range(2):
        (torch_train, torch_test), (dev_train, dev_test) = loaders_both_ways(
            data, rank=rank, device=torch.device("cpu"), batch_size=32, eval_batch=16, epoch=1, start=64)
        a, b = list(torch_train), list(dev_train)
        assert len(a) == len(b) == 3 and all(x.shape[1:] == shape for x, _ in a + b)
        assert all(torch.equal(ya, yb) for (_, ya), (_, yb) in zip(a, b))
        assert all(torch.equal(xa, xb) and torch.equal(ya, yb)
                   for (xa, ya), (xb, yb) in zip(torch_test, dev_test))


def test_a_dataset_s_integer_labels_of_any_kind_reach_the_loss_as_int64():
    """torch.int32 and numpy integers from a user's Dataset: collated as int64, as cross_entropy needs."""
    import numpy as np
    items = Files([(torch.full((1, 8, 8), i, dtype=torch.uint8), label) for i, label in
                   enumerate([torch.tensor(0, dtype=torch.int32), np.int64(1), 1, torch.tensor(0)])])
    items.mean, items.std = (0.5,), (0.25,)
    assert du.measure_data(items, items).num_classes == 2
    train, test = support.build_loaders(items, items, batch_size=4, rank=0, world_size=1, accum_steps=1,
                                        eval_batch=4, seed=0, workers=0, pin_memory=False)
    train.batch_sampler.set_epoch(1)
    for loader in (train, test):
        (images, labels), = list(loader)
        assert images.shape == (4, 1, 8, 8) and labels.dtype == torch.int64


def test_the_workers_socket_check_refuses_exactly_the_temporary_folders_a_socket_cannot_bind_in(tmp_path,
                                                                                                 monkeypatch):
    """The longest path a Unix socket binds at, found here for real, is SOCKET_PATH_MAX; check_worker_sockets
    passes the temporary folder whose forkserver socket would be that long, refuses the one a byte longer in one
    line naming the folder, its limit and the ways out, and looks at nothing without workers."""
    import multiprocessing.connection
    import multiprocessing.util
    import os
    import socket
    from machinery.errors import UserError

    def folder_of(size):  # a path under tmp_path of `size` bytes
        return str(tmp_path / ("d" * (size - len(str(tmp_path)) - 1)))

    def binds(size):
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.bind(folder_of(size))
                return True
            except OSError:
                return False
    longest = next(size for size in range(len(str(tmp_path)) + 2, 200) if not binds(size)) - 1
    assert longest == loader_workers.SOCKET_PATH_MAX
    # The name multiprocessing gives the socket in its folder (listener-XXXXXXXX, or sock-XXXXXXXX on newer
    # Pythons), measured as the check measures it.
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: "/t")
    name = len(multiprocessing.connection.arbitrary_address("AF_UNIX")) - len("/t")
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: folder_of(longest - name))
    loader_workers.check_worker_sockets(1)
    too_long = folder_of(longest + 1 - name)
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: too_long)
    with pytest.raises(UserError) as refused:
        loader_workers.check_worker_sockets(2)
    tmpdir = os.path.dirname(too_long)
    assert str(refused.value) == (
        f"TMPDIR {tmpdir} ({len(tmpdir)} bytes) is too long for the DataLoader workers' socket in it "
        f"({longest + 1} bytes, over {longest}): set TMPDIR to at most {len(tmpdir) - 1} bytes "
        f"(export TMPDIR=/tmp) or use --workers 0")

    def looked():
        raise AssertionError("looked for the socket's folder without workers")
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", looked)
    loader_workers.check_worker_sockets(0)


def test_loader_workers_are_forked_from_a_forkserver_that_has_imported_torch(monkeypatch):
    """Each worker inherits torch from the forkserver that forks it instead of importing it again (2 to 3
    CPU-seconds a worker, at every loader's start): the workers' parent has torch's library loaded. Python 3.11
    and 3.12 never preload the script there (python/cpython#126631), so the recipe names torch."""
    import multiprocessing.forkserver
    server = multiprocessing.forkserver._forkserver
    # the forkserver the recipe's loaders start, from Python's default list: not one a test here started,
    # nor with the list it set (forked_ranks.PRELOAD has torch)
    monkeypatch.setattr(server, "_preload_modules", ["__main__"])
    server._stop()
    data = du.ImageData(torch.from_numpy(index_images(16)), torch.arange(16))
    _, test_loader = support.build_loaders(data, data, batch_size=4, rank=0, world_size=1, accum_steps=1,
                                           eval_batch=4, seed=0, workers=2, pin_memory=False)
    batches = iter(test_loader.loader)
    try:
        assert len(next(batches)[1]) == 4
        parents = set()
        for worker in batches._workers:
            with open(f"/proc/{worker.pid}/stat") as f:
                parents.add(int(f.read().rsplit(")", 1)[1].split()[1]))
        assert parents == {server._forkserver_pid}, "the workers were not forked by the forkserver"
        with open(f"/proc/{server._forkserver_pid}/maps") as f:
            assert "libtorch_cpu" in f.read(), "the workers' forkserver had not imported torch"
    finally:
        batches._shutdown_workers()
