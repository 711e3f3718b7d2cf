"""Wide Residual Network (Zagoruyko & Komodakis, 2016, https://arxiv.org/abs/1605.07146): WRN-d-k has three groups
of n = (d - 4) / 6 pre-activation basic blocks (BN-ReLU before each 3x3 conv, maybe dropout between the two, 1x1
projections where the shape changes) of 16k, 32k and 64k channels, as the paper's code. Your own network replaces
`build_model` and `model_config` in train_ddp.py; nothing else depends on this file."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def check_depth(depth: int) -> int:
    """Return n, the blocks per group, or raise ValueError for a depth that is not 6n+4."""
    if depth < 10 or (depth - 4) % 6 != 0:
        raise ValueError(f"WideResNet depth must be 6n+4 with n >= 1 (10, 16, 22, 28, 40, ...), "
                         f"got {depth}")
    return (depth - 4) // 6


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, out_planes: int, stride: int, dropout: float):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes)
        self.conv2 = nn.Conv2d(out_planes, out_planes, 3, stride=1, padding=1, bias=False)
        self.dropout = dropout
        self.shortcut = None  # the projection sees the pre-activated input, as in the paper's code
        if stride != 1 or in_planes != out_planes:
            self.shortcut = nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = F.relu(self.bn1(x))
        residual = x if self.shortcut is None else self.shortcut(o)
        o = self.conv1(o)
        o = F.relu(self.bn2(o))
        if self.dropout > 0:
            o = F.dropout(o, p=self.dropout, training=self.training)
        return self.conv2(o) + residual


class WideResNet(nn.Module):
    def __init__(self, depth: int = 16, widen_factor: int = 8, num_classes: int = 100, dropout: float = 0.0,
                 in_channels: int = 3):
        super().__init__()
        n = check_depth(depth)
        if widen_factor < 1:
            raise ValueError(f"WideResNet widen_factor must be >= 1, got {widen_factor}")
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        layers, in_planes = [], widths[0]
        for group, out_planes in enumerate(widths[1:]):
            for i in range(n):
                stride = 2 if (group > 0 and i == 0) else 1
                layers.append(BasicBlock(in_planes, out_planes, stride, dropout))
                in_planes = out_planes
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(in_planes)
        self.fc = nn.Linear(in_planes, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # BatchNorm's ones and zeros are torch's defaults
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.conv1(x))
        x = F.relu(self.bn(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)
