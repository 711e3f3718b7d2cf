"""What the records and the Data line call load_data's data: their name, their image sizes, and the size flags that
load_data did not take. Loaded when the data are checked (dataset_utils.load_checked_data)."""
import torch

from machinery.output import log

SYNTHETIC_SOURCE = "synthetic (learnable, of CIFAR-100's shape)"  # what the records call --dataset synthetic


def records_name(dataset: str, data_dir: str, source: str) -> str:
    """What the records call the data load_data returned from `source`: --dataset's name where they are the data it
    names (dataset_utils.load_split's), else `source`, as the Data line names them."""
    named = SYNTHETIC_SOURCE if dataset == "synthetic" else f"CIFAR-100 in {data_dir}"  # load_split's sources
    return dataset if source == named else source


def check_sizes(cfg, train, test, channels: int) -> str:
    """The Data line's sizes of the training images (describe_sizes; "" without them, --evaluate), after a note for
    a size flag load_data did not take."""
    note_sizes_not_taken(cfg, train, test)
    return "" if train is None else describe_sizes(train, channels)


def note_sizes_not_taken(cfg, train, test) -> None:
    """A note for --train-size or --test-size that load_data did not take (it returned another number)."""
    for flag, size, split, name in (("--train-size", cfg.train_size, train, "train_size"),
                                    ("--test-size", cfg.test_size, test, "test_size")):
        if size and split is not None and len(split) != size:
            log(f"note: {flag} {size} does nothing here: load_data returned {len(split)} samples; take the first "
                f"cfg.{name} in load_data (dataset_utils.image_folder: samples=cfg.{name})")


def describe_sizes(split, channels: int) -> str:
    """The Data line's image sizes: ImageData's one size; a Dataset's range where mean_std read its images
    (`1 x 12..16 x 12..16`, machinery/image_folders.py's ImageSizes), else its first image's size, said as such."""
    if isinstance(getattr(split, "images", None), torch.Tensor):  # ImageData
        return " x ".join(map(str, split.images.shape[1:]))
    sizes = getattr(split, "image_sizes", None)
    if sizes is not None and hasattr(sizes, "describe"):
        return sizes.describe(channels)
    from machinery.bad_samples import first_readable
    return f"{' x '.join(map(str, first_readable(split, 'training')[0][0].shape))} (the first)"
