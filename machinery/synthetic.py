"""--dataset synthetic: learnable images of CIFAR-100's shape, no download."""
import math

import torch


def learnable_images(n: int, train: bool, *, seed: int = 0, num_classes: int) -> tuple:
    """(uint8 images N x 3 x 32 x 32, int64 labels): a colour and grating per class, noise per image."""
    classes = torch.Generator().manual_seed(1234)  # the class patterns: one set for train and test
    colour = torch.empty(num_classes, 3, 1, 1).uniform_(50, 205, generator=classes)
    freq = torch.randint(1, 4, (num_classes, 2, 1, 1), generator=classes).float()
    phase = torch.empty(num_classes, 1, 1).uniform_(0, 2 * math.pi, generator=classes)
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    grating = torch.sin(2 * math.pi * (freq[:, 0] * xx + freq[:, 1] * yy) / 32 + phase)  # (classes, 32, 32)
    patterns = colour + 45 * grating[:, None]
    g = torch.Generator().manual_seed(seed * 2 + int(train))
    labels = torch.randint(0, num_classes, (n,), dtype=torch.int64, generator=g)
    images = torch.empty(n, 3, 32, 32, dtype=torch.uint8)
    for chunk in torch.arange(n).split(8192):  # in chunks: 50,000 float images would take 600 MB
        noise = torch.randn(len(chunk), 3, 32, 32, generator=g) * 24
        images[chunk] = (patterns[labels[chunk]] + noise).round_().clamp_(0, 255).to(torch.uint8)
    return images, labels
