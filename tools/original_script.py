"""The original script (the train_ddp.py of the "PyTorch on Olivia" guide) as bench.py compares against
it: its per-sample PIL transform, its input pipeline in DataLoader workers and its training loop.
bench.py --compare-original times them; --cpu-checks (cpu_checks.py) times the transform per core."""
import itertools

import torch
import torch.nn as nn

import dataset_utils as du
from machinery.loader_workers import deaf_to_stop_signals, stop_signals_held
from machinery.timing import Clock


def original_transform():
    """The original script's per-sample training transform on PIL images."""
    import torchvision.transforms as T
    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD)])


class PILSet(torch.utils.data.Dataset):
    """The training images as torchvision's CIFAR100 serves them: PIL images through `transform`."""

    def __init__(self, data, transform):
        self.images = data.images.permute(0, 2, 3, 1).numpy()  # HWC uint8
        self.labels, self.transform = data.labels, transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        from PIL import Image
        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def original_batches(data, per_rank_batch, env, workers, device):
    """The original script's input pipeline: PIL images through torchvision transforms in DataLoader
    workers. Closing the generator shuts the workers down. The workers are born holding the stop signals and
    then ignore them, as the recipe's are: a Ctrl-C to the process group while one starts would otherwise print
    its traceback; the tool's stop handler ends them."""
    from torch.utils.data import DataLoader, DistributedSampler
    dataset = PILSet(data, original_transform())
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank)
    loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda", persistent_workers=workers > 0, drop_last=True,
                        worker_init_fn=deaf_to_stop_signals if workers else None)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        with stop_signals_held():  # the workers start here (once: persistent_workers)
            batches = iter(loader)
        for images, labels in batches:
            yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def original_steps(model, batches, optimizer, scaler, amp_dtype, device, steps, warmup) -> float:
    """The original script's training loop (a mean loss, no loss bookkeeping); seconds per step after
    warm-up."""
    clock, loss_fn = Clock(device), nn.CrossEntropyLoss()
    model.train()
    start = None
    for i in range(warmup + steps):
        if i == warmup:
            start = clock.mark()
        images, labels = next(batches)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return clock.seconds(start, clock.mark()) / steps
