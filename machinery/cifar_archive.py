"""CIFAR-100's archive: fetched once (or placed by hand), md5-checked, extracted atomically."""
import os
import pickle
import socket
import tempfile

import torch

from machinery.errors import UserError

CIFAR100_URL = os.environ.get("CIFAR100_URL", "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz")  # or a mirror
CIFAR100_ARCHIVE = "cifar-100-python.tar.gz"
CIFAR100_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"  # these are torchvision's CIFAR100's (a test checks)
CIFAR100_FOLDER = "cifar-100-python"


def fetch_cifar100(data_dir: str) -> None:
    """Extract the archive (downloaded if absent) via a temporary folder: no half-written file."""
    folder = os.path.join(data_dir, CIFAR100_FOLDER)
    if all(os.path.isfile(os.path.join(folder, f)) for f in ("train", "test", "meta")):
        return
    from torchvision.datasets.utils import check_integrity, download_url, extract_archive  # here: it takes a second
    archive = os.path.join(data_dir, CIFAR100_ARCHIVE)
    try:
        os.makedirs(data_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=data_dir, prefix=".extract-") as tmp:
            if not os.path.isfile(archive):
                timeout = socket.getdefaulttimeout()
                socket.setdefaulttimeout(60)  # nodes without internet drop packets
                try:
                    download_url(CIFAR100_URL, tmp, CIFAR100_ARCHIVE, md5=CIFAR100_MD5)
                except Exception as e:
                    raise UserError(f"CIFAR-100 is not in {os.path.abspath(data_dir)} and downloading it failed "
                                    f"({e!r}); place {CIFAR100_ARCHIVE} (from {CIFAR100_URL}) there, or use "
                                    f"--dataset synthetic") from None
                finally:
                    socket.setdefaulttimeout(timeout)
                os.replace(os.path.join(tmp, CIFAR100_ARCHIVE), archive)
            if not check_integrity(archive, CIFAR100_MD5):
                raise UserError(f"{archive} fails its md5 check (expected {CIFAR100_MD5}): delete it to download it "
                                f"again, or copy a good one there")
            extract_archive(archive, tmp)
            try:
                os.rename(os.path.join(tmp, CIFAR100_FOLDER), folder)
            except OSError:
                if not os.path.isdir(folder):  # else another node won the race: fine
                    raise
    except OSError as e:
        raise UserError(f"cannot prepare CIFAR-100 in {data_dir}: {e}") from e


class SafeUnpickler(pickle.Unpickler):
    """The CIFAR pickles hold dicts, lists and numpy arrays: nothing else."""
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        return super().find_class(module, name)


def read_split(data_dir: str, train: bool, *, num_classes: int) -> tuple:
    """(uint8 images N x 3 x 32 x 32, int64 labels) of a split, else UserError."""
    path = os.path.join(data_dir, CIFAR100_FOLDER, "train" if train else "test")
    try:
        with open(path, "rb") as f:
            entry = SafeUnpickler(f, encoding="latin1").load()
        data = torch.as_tensor(entry["data"])
        labels = torch.as_tensor(entry["fine_labels"], dtype=torch.int64)
        n = labels.numel()
        if data.dtype != torch.uint8 or data.shape != (n, 3072) or not 0 <= labels.min() <= labels.max() < num_classes:
            raise ValueError(f"expected ({n}, 3072) uint8 data and labels in [0, {num_classes})")
    except Exception as e:
        raise UserError(f"{path} is unreadable ({e!r}); delete {os.path.dirname(path)} to extract it again") from None
    return data.view(n, 3, 32, 32), labels
