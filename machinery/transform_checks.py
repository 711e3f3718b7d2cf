"""build_transforms' transforms, checked before the first step; where a per-image one runs."""
import pickle

import torch

from machinery.bad_samples import describe_exception, describe_image, first_readable, resize_fix
from machinery.errors import UserError, call_and_agree
from machinery.hashing import seeded
from machinery.loader_workers import check_worker_sockets
from machinery.output import log


def check_transforms(data, train, test) -> tuple:
    """The model's input shape: what both transforms (None: none) make of their first image."""
    shapes = {}
    for name, split, transform in (("training", data.train, train), ("test", data.test, test)):
        if split is None:  # --evaluate: no training split
            continue
        in_memory = isinstance(getattr(split, "images", None), torch.Tensor)  # ImageData
        image = split.images[0] if in_memory else first_readable(split, name)[0][0]
        what = (f"the {name} transform (build_transforms in train_ddp.py)" if transform is not None else
                f"the {name} images (no {name} transform)")
        try:
            out = image if transform is None else seeded(transform, (image,), 0)
        except Exception as e:  # noqa: BLE001 - named, with where it was raised
            raise UserError(f"{what} failed on a {describe_image(image)} image: {describe_exception(e)}") from e
        if not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.dim() == 3
                and out.shape[0] == image.shape[0]):
            got = f"a {describe_image(out)} tensor" if isinstance(out, torch.Tensor) else describe_image(out)
            raise UserError(f"{what} returned {got} for a {describe_image(image)} image, not uint8 C x H x W of its "
                            f"{image.shape[0]} channels (v2.PILToTensor() or v2.ToDtype(torch.uint8, scale=True))")
        shapes[name] = tuple(out.shape), what, tuple(image.shape)
        if name == "training" and transform is not None and any(  # 4 runs: a coin flip shows in 7/8
                not torch.equal(out, seeded(transform, (image,), 0)) for _ in range(3)):
            log("note: the training transform gave two outputs for one seed: it draws from elsewhere than torch's "
                "generator, so resumes and other rank counts train otherwise: use torch.rand/randint (docs/adapt.md)")
    (shape, what, first), *others = shapes.values()
    for other_shape, other, _ in others:
        if other_shape != shape:
            fix = f"a test transform giving it (e.g. v2.Resize({shape[1]}) and v2.CenterCrop({tuple(shape[1:])}))"
            fix = fix if test is not None else f"{resize_fix(data.test, shape)}; or {fix}"  # or images that size
            raise UserError(f"{what} gives images of {' x '.join(map(str, shape))} but {other} of "
                            f"{' x '.join(map(str, other_shape))}: the model takes one size: {fix}")
    if shape != first:  # photos of any size: the data line gives the first's
        log(f"Input: the transforms make each image {' x '.join(map(str, shape))}, the model's input (the first "
            f"{next(iter(shapes))} image: {' x '.join(map(str, first))})")
    return shape


def where_transform_runs(*, device, loader: str, workers: int):
    """Where a transform of data in memory runs: `device` (--loader gpu), else workers (None)."""
    where = (f"on the {device.type} (--loader torch: in DataLoader workers)" if loader == "gpu" else
             f"in {workers} DataLoader worker(s) per rank (--loader gpu: on the {device.type})")
    log(f"note: the training transform is not the batched crop and flip: it runs per image {where}")
    if loader == "gpu":
        return device
    call_and_agree(check_worker_sockets, workers)
    return None


def workers_take(train, train_tf, test_tf, *, workers: int) -> None:
    """Says where a Dataset's transform runs; with workers, checks that the transforms pickle."""
    if train is not None and train_tf is not None and not isinstance(getattr(train, "images", None), torch.Tensor):
        where = (f"in {workers} DataLoader worker{'s' if workers > 1 else ''} per rank" if workers else
                 "in each rank's own process (--workers 0)")
        log(f"Augmentation: the training transform runs per image {where}, with the reads of load_data's Dataset")
    if workers:
        call_and_agree(check_sendable, {"training": train_tf if train is not None else None, "test": test_tf})


def check_sendable(transforms: dict) -> None:
    for name, transform in transforms.items():
        try:
            pickle.dumps(transform)
        except Exception as e:  # noqa: BLE001 - PicklingError, AttributeError or TypeError
            raise UserError(f"the {name} transform (build_transforms in train_ddp.py) cannot be sent to the "
                            f"DataLoader workers ({str(e).splitlines()[0]}): make its functions top-level (no lambda, "
                            f"nothing defined in build_transforms), or use --workers 0") from None
