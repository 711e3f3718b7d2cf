"""CIFAR-100's archive: downloaded once (or placed by hand), md5-checked, extracted into place atomically."""
import os
import socket
import tempfile

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
    # torchvision's helpers, imported here: every rank imports this module, and so may each of its loader
    # workers (machinery/loader_workers.py); torchvision's import costs each a second
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
