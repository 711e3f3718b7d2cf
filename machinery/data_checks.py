"""Data checks that need no knowledge of the recipe's data contract: classes, channel statistics."""
import torch

from machinery.errors import UserError


def stated_classes(split) -> int | None:
    """The number of classes a split states: num_classes, or the length of its `classes`."""
    return getattr(split, "num_classes", None) or len(class_names(split) or ()) or None


def class_names(split) -> tuple | None:
    names = getattr(split, "classes", None)
    return tuple(map(str, names)) if isinstance(names, (list, tuple)) and len(names) else None


def check_same_classes(names, test, source: str) -> None:
    """UserError unless each test class has its `names` index (ImageFolder: a missing folder renumbers the rest)."""
    mapping = getattr(test, "class_to_idx", None)
    test_index = ({str(c): i for c, i in mapping.items()} if isinstance(mapping, dict) and mapping else
                  {c: i for i, c in enumerate(class_names(test) or ())})
    index = {c: i for i, c in enumerate(names or ())}
    if not index or not test_index or all(index.get(c) == i for c, i in test_index.items()):
        return
    from machinery.diagnose import describe_class_mismatch
    raise UserError(describe_class_mismatch(index, test_index, source))


def channel_stats(images: torch.Tensor) -> tuple:
    """Per-channel mean and std / 255 of uint8 images (N, C, H, W), exact."""
    total = squares = 0
    for chunk in images.split(4096):  # int64 copies of 4096 images at a time, not of the whole set
        x = chunk.to(torch.int64)
        total += x.sum(dim=(0, 2, 3))
        squares += (x * x).sum(dim=(0, 2, 3))
    return mean_std_of_sums(total, squares, images.numel() // images.shape[1])


def mean_std_of_sums(total: torch.Tensor, squares: torch.Tensor, count: int) -> tuple:
    """Per-channel mean and std / 255 from integer sums: exact, the same on every rank."""
    mean = total.double() / count
    std = (squares.double() / count - mean ** 2).clamp_min(0).sqrt()
    std = torch.where(std > 0, std, 255.0)  # a constant channel: leave its scale alone
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())
