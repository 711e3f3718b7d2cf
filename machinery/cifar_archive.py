"""CIFAR-100's files: the archive downloaded once (or placed by hand), md5-checked, extracted into place
atomically; its pickles read safely. Imported for CIFAR-100 only (dataset_utils)."""
import os
import pickle
import socket
import tempfile

import torch

from machinery.errors import UserError

# The official archive, as torchvision's CIFAR100 names and verifies it (tests/unit/test_cifar_archive.py
# checks that they agree). CIFAR100_URL in the environment points at a mirror instead (the md5 check still
# applies).
CIFAR100_URL = os.environ.get("CIFAR100_URL", "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz")
CIFAR100_ARCHIVE = "cifar-100-python.tar.gz"
CIFAR100_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"
CIFAR100_FOLDER = "cifar-100-python"


def fetch_cifar100(data_dir: str) -> None:
    """Extract data_dir/cifar-100-python.tar.gz if data_dir/cifar-100-python/ is not there, downloading
    it first if absent.

    The archive's md5 is checked before anything is extracted. Downloads and extractions go
    to a private temporary folder and are renamed into place, so processes on several nodes
    that share data_dir never see a half-written file.
    """
    # torchvision's helpers, imported when called: torchvision's import costs a process a second
    from torchvision.datasets.utils import check_integrity, extract_archive
    folder = os.path.join(data_dir, CIFAR100_FOLDER)
    if all(os.path.isfile(os.path.join(folder, f)) for f in ("train", "test", "meta")):
        return
    archive = os.path.join(data_dir, CIFAR100_ARCHIVE)
    try:
        os.makedirs(data_dir, exist_ok=True)
        if not os.path.isfile(archive):
            _download(data_dir)
        if not check_integrity(archive, CIFAR100_MD5):
            raise UserError(
                f"{archive} fails its md5 check (expected {CIFAR100_MD5}): it is corrupt or incomplete; "
                f"delete it and run again to download it, or copy a good one there"
            )
        with tempfile.TemporaryDirectory(dir=data_dir, prefix=".extract-") as tmp:
            extract_archive(archive, tmp)
            if not os.path.isdir(os.path.join(tmp, CIFAR100_FOLDER)):
                raise UserError(f"{archive} does not contain {CIFAR100_FOLDER}/; delete it and download it "
                                f"again")
            try:
                os.rename(os.path.join(tmp, CIFAR100_FOLDER), folder)
            except OSError:
                if not os.path.isdir(folder):  # else another node won the race: fine
                    raise
    except OSError as e:
        raise UserError(f"cannot prepare CIFAR-100 in {data_dir}: {e}") from e


def _download(data_dir: str) -> None:
    from torchvision.datasets.utils import download_url
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".download-") as tmp:
        old_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(60)  # compute nodes without internet often drop packets: don't hang
        try:
            download_url(CIFAR100_URL, tmp, CIFAR100_ARCHIVE, md5=CIFAR100_MD5)
        except Exception as e:
            raise UserError(
                f"CIFAR-100 is not in {os.path.abspath(data_dir)} and downloading it failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); place {CIFAR100_ARCHIVE} "
                f"(from {CIFAR100_URL}) in that directory, or use --dataset synthetic"
            ) from None
        finally:
            socket.setdefaulttimeout(old_timeout)
        os.replace(os.path.join(tmp, CIFAR100_ARCHIVE), os.path.join(data_dir, CIFAR100_ARCHIVE))


class SafeUnpickler(pickle.Unpickler):
    """The CIFAR pickles hold dicts, lists and numpy arrays; refuse anything else."""
    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        return super().find_class(module, name)


def read_split(data_dir: str, train: bool, *, num_classes: int) -> tuple:
    """(uint8 images N x 3 x 32 x 32, int64 labels) of the train or test pickle; UserError if it does not
    read as that."""
    path = os.path.join(data_dir, CIFAR100_FOLDER, "train" if train else "test")
    try:
        with open(path, "rb") as f:
            entry = SafeUnpickler(f, encoding="latin1").load()
        data = torch.as_tensor(entry["data"])
        labels = torch.as_tensor(entry["fine_labels"], dtype=torch.int64)
        n = labels.numel()
        if data.dtype != torch.uint8 or data.shape != (n, 3 * 32 * 32):
            raise ValueError(f"data is {tuple(data.shape)} {data.dtype}, expected ({n}, 3072) uint8")
        if n == 0 or labels.min() < 0 or labels.max() >= num_classes:
            raise ValueError(f"labels must lie in [0, {num_classes})")
    except Exception as e:
        raise UserError(
            f"{path} is unreadable ({type(e).__name__}: {e}); delete {os.path.dirname(path)} to extract it "
            f"again"
        ) from None
    return data.view(n, 3, 32, 32).contiguous(), labels
