"""Checks of train_ddp.build_transforms' transforms before the first step (what they return, whether they draw from
torch's generator), and where a training transform other than the default crop and flip (which the device loader
batches) runs, with its rate.
Loaded when the loaders are built (dataset_utils.build_loaders)."""
import time

import torch

from machinery.bad_samples import describe_exception, describe_image, resize_fix
from machinery.errors import UserError, call_and_agree
from machinery.hashing import seeded
from machinery.output import log


def first_image(split, name: str) -> torch.Tensor:
    """The first image of a split that reads (ImageData's first)."""
    if isinstance(getattr(split, "images", None), torch.Tensor):
        return split.images[0]
    from machinery.bad_samples import first_readable
    return first_readable(split, name)[0][0]


def check_transforms(data, train, test) -> tuple:
    """The model's input shape (C, H, W): what the training transform makes of the first training image, the same
    as the test transform (None: as it is) makes of the first test image. UserError, naming the transform and what it
    returned, unless both give uint8 tensors of the image's channels and that one shape; a note if the training
    transform gives two outputs for one seed in 4 runs (it draws from elsewhere than torch's generator)."""
    shapes, firsts = {}, {}
    for name, split, transform in (("training", data.train, train), ("test", data.test, test)):
        if split is None:  # --evaluate: no training split
            continue
        image = first_image(split, name)
        what = (f"the {name} transform (build_transforms in train_ddp.py)" if transform is not None else
                f"the {name} images (no {name} transform)")
        try:
            out = image if transform is None else seeded(transform, (image,), 0)
        except Exception as e:  # noqa: BLE001 - said in one line, with where it was raised
            raise UserError(f"{what} failed on the first {name} image, {describe_image(image)}: "
                            f"{describe_exception(e)}") from e
        if not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.dim() == 3
                and out.shape[0] == image.shape[0]):
            got = (f"a {' x '.join(map(str, out.shape))} {str(out.dtype).removeprefix('torch.')} tensor"
                   if isinstance(out, torch.Tensor) else f"a {type(out).__module__}.{type(out).__name__}")
            raise UserError(f"{what} returned {got} for a {' x '.join(map(str, image.shape))} uint8 image: it "
                            f"must return a uint8 tensor C x H x W of the image's {image.shape[0]} channels (a PIL "
                            f"image: end with v2.PILToTensor(); float: v2.ToDtype(torch.uint8, scale=True))")
        shapes[name], firsts[name] = (tuple(out.shape), what), tuple(image.shape)
        if name == "training" and transform is not None and any(  # 4 runs: a coin flip drawn elsewhere shows in 7/8
                not torch.equal(out, seeded(transform, (image,), 0)) for _ in range(3)):
            log("note: the training transform gave two outputs for one seed: it draws from elsewhere than torch's "
                "generator (Python's random, NumPy, a Generator of its own), so a resume or another number of ranks "
                "will not train the same: draw with torch.rand or torch.randint (docs/adapt.md)")
    (shape, what), *others = shapes.values()
    for other_shape, other in others:
        if other_shape != shape:
            h, w = shape[1:]
            fix = f"a test transform giving it (e.g. v2.Resize({h}) and v2.CenterCrop(({h}, {w})))"
            if test is None:  # or load_data's images of that size
                fix = f"{resize_fix(data.test, shape)}; or {fix}"
            raise UserError(f"{what} gives images of {' x '.join(map(str, shape))} but {other} of "
                            f"{' x '.join(map(str, other_shape))} (channels x height x width): the model takes one "
                            f"size: {fix}")
    name, first = next(iter(firsts.items()))
    if shape != first:  # photos of any size, say: the data line gives the first's size
        log(f"Input: the transforms make each image {' x '.join(map(str, shape))}, the model's input (the first "
            f"{name} image: {' x '.join(map(str, first))})")
    return shape


def check_sendable(transforms: dict) -> None:
    """UserError, naming the transform, unless each of `transforms` ({"training": ..., "test": ...}, None: none)
    pickles: the DataLoader workers get them pickled from a forkserver (machinery/loader_workers.py), so a lambda or a
    function defined inside build_transforms cannot reach them. Said before any worker starts, in one line."""
    import pickle
    for name, transform in transforms.items():
        if transform is None:
            continue
        try:
            pickle.dumps(transform)
        except Exception as e:  # noqa: BLE001 - pickle raises PicklingError, AttributeError or TypeError
            raise UserError(f"the {name} transform (build_transforms in train_ddp.py) cannot be sent to the "
                            f"DataLoader workers ({str(e).splitlines()[0]}): make each of its functions a top-level "
                            f"function or class of a module (not a lambda or a function defined inside "
                            f"build_transforms), or run with --workers 0") from None


def transform_rate(transform, image: torch.Tensor, images: int = 20) -> float:
    """Images a second `transform` takes, seeded, on `image`'s device, one at a time."""
    seeded(transform, (image,), 0)  # the first call's start-up left out
    start = time.perf_counter()
    for i in range(images):
        seeded(transform, (image,), i + 1)
    if image.is_cuda:
        torch.cuda.synchronize(image.device)
    return images / (time.perf_counter() - start)


def where_transform_runs(transform, image: torch.Tensor, *, device, loader: str, workers: int):
    """Where a training transform other than the device loader's crop and flip runs (for data in memory), said in
    one line with its rate: per image on `device` (--loader gpu), else in the DataLoader workers (None)."""
    if loader == "gpu":
        log(f"note: the training transform is not the device loader's batched crop and flip: it runs per image on "
            f"the {device.type}, {transform_rate(transform, image.to(device)):.0f} img/s on rank 0 (measured now); "
            f"--loader torch runs it in DataLoader workers")
        return device
    log(f"note: the training transform is not the device loader's batched crop and flip: it runs per image in "
        f"{workers} DataLoader worker(s) per rank, {transform_rate(transform, image):.0f} img/s each on this CPU "
        f"(measured now); --loader gpu runs it per image on the {device.type}")
    from machinery.loader_workers import check_worker_sockets
    call_and_agree(check_worker_sockets, workers)
    return None


def workers_take(train, train_tf, test_tf, *, workers: int) -> None:
    """For the DataLoader's loaders (`train`: None for --evaluate): a Dataset's training transform, said where it runs,
    per image, with its rate; then, with workers, the check that they can be sent the transforms (check_sendable)."""
    if train is not None and train_tf is not None and not isinstance(getattr(train, "images", None), torch.Tensor):
        where = (f"in {workers} DataLoader worker{'s' if workers > 1 else ''} per rank" if workers else
                 "in each rank's own process (--workers 0)")
        rate = transform_rate(train_tf, first_image(train, "training"))
        log(f"Augmentation: the training transform runs per image {where}, with the reads of load_data's Dataset; "
            f"{rate:.0f} img/s per process on this CPU, the reads apart (measured now)")
    if workers:
        call_and_agree(check_sendable, {"training": train_tf if train is not None else None, "test": test_tf})
