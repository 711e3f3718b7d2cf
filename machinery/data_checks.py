"""Data checks that need no data contract: classes, channel statistics."""
import torch

from machinery.errors import UserError


def stated_classes(split) -> int | None:
    """The classes a split states: num_classes, or len(classes)."""
    return getattr(split, "num_classes", None) or len(class_names(split) or ()) or None


def class_names(split) -> tuple | None:
    names = getattr(split, "classes", None)
    return tuple(map(str, names)) if isinstance(names, (list, tuple)) and len(names) else None


def check_same_classes(names, test, source: str) -> None:
    """UserError unless each test class has its `names` index (a missing folder renumbers the rest)."""
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
    values = torch.arange(256)  # counts of each value: exact, with no int64 copy
    counts = torch.stack([torch.bincount(channel.flatten(), minlength=256) for channel in images.unbind(1)]).cpu()
    return mean_std_of_sums(counts @ values, counts @ values ** 2, images.numel() // images.shape[1])


def mean_std_of_sums(total: torch.Tensor, squares: torch.Tensor, count: int) -> tuple:
    """Per-channel mean and std / 255 from integer sums: exact, the same on every rank."""
    mean = total.double() / count
    std = (squares.double() / count - mean ** 2).clamp_min(0).sqrt()
    std = torch.where(std > 0, std, 255.0)  # a constant channel: leave its scale alone
    return tuple((mean / 255).tolist()), tuple((std / 255).tolist())
