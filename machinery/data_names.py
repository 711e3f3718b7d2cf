"""What the records and the Data line call load_data's data, and its image sizes."""
import torch

from machinery.output import log

SYNTHETIC_SOURCE = "synthetic (learnable, of CIFAR-100's shape)"  # the records' name for --dataset synthetic


def records_name(dataset: str, data_dir: str, source: str) -> str:
    """--dataset's name where load_data returned the data it names, else `source`."""
    named = SYNTHETIC_SOURCE if dataset == "synthetic" else f"CIFAR-100 in {data_dir}"  # load_split's sources
    return dataset if source == named else source


def check_sizes(cfg, train, test, channels: int) -> str:
    """The Data line's image sizes ("" for --evaluate); a note for a size flag load_data ignored."""
    for name, split in (("train_size", train), ("test_size", test)):
        if (size := getattr(cfg, name)) and split is not None and len(split) != size:
            log(f"note: --{name.replace('_', '-')} {size} does nothing here: load_data returned {len(split)} samples; "
                f"take the first cfg.{name} in load_data (dataset_utils.image_folder: samples=cfg.{name})")
    if train is None:
        return ""
    if isinstance(getattr(train, "images", None), torch.Tensor):  # ImageData
        return " x ".join(map(str, train.images.shape[1:]))
    if isinstance(getattr(train, "image_sizes", None), str):
        return f"{channels} x {train.image_sizes}"
    from machinery.bad_samples import first_readable
    return f"{' x '.join(map(str, first_readable(train, 'training')[0][0].shape))} (the first)"
