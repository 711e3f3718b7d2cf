"""Reading CIFAR-100: the real archive code on generated archives in the official format (md5 check,
extraction, the safe unpickler, the offline message), the synthetic stand-in's shapes, and the size flags."""
import os
import pickle

import pytest
import torch

import dataset_utils as du
from machinery import cifar_archive
from support import ROOT, write_cifar100
from machinery.errors import UserError


def test_the_archive_s_name_md5_and_folder_are_torchvision_s():
    """cifar_archive states the official archive's facts itself (torchvision's import costs a second):
    they are the ones torchvision's CIFAR100 downloads and verifies."""
    from torchvision.datasets import CIFAR100
    assert (cifar_archive.CIFAR100_ARCHIVE, cifar_archive.CIFAR100_MD5, cifar_archive.CIFAR100_FOLDER) == (
        CIFAR100.filename, CIFAR100.tgz_md5, CIFAR100.base_folder)
    if "CIFAR100_URL" not in os.environ:
        assert cifar_archive.CIFAR100_URL == CIFAR100.url


def test_the_project_s_modules_import_no_torchvision():
    """train_ddp.py and its modules leave torchvision (and the torch._dynamo it imports) to the paths that
    use it: each rank and its loader workers' forkserver start a second sooner."""
    import subprocess
    import sys
    probe = "import sys, train_ddp; print(sorted({m.split('.')[0] for m in sys.modules} & {'torchvision'}))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reads_a_generated_archive_in_the_official_format(tmp_path, monkeypatch):
    md5 = write_cifar100(str(tmp_path), 250, 120, seed=3)
    # Read back what was written, independently of the code under test.
    write_cifar100(str(tmp_path / "ref"), 250, 120, seed=3, archive=False)
    # the generated archive's md5 stands in for the real one
    monkeypatch.setattr(cifar_archive, "CIFAR100_MD5", md5)
    du.prepare_cifar100(str(tmp_path))
    assert sorted(os.listdir(tmp_path / "cifar-100-python")) == ["meta", "test", "train"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary leftovers
    for split, n in (("train", 250), ("test", 120)):
        data = du.load_split("cifar100", str(tmp_path), split == "train")
        with open(tmp_path / "ref" / "cifar-100-python" / split, "rb") as f:
            ref = pickle.load(f, encoding="latin1")
        assert data.images.dtype == torch.uint8 and data.images.shape == (n, 3, 32, 32)
        assert data.labels.dtype == torch.int64 and data.labels.tolist() == ref["fine_labels"]
        assert torch.equal(data.images.reshape(n, -1), torch.from_numpy(ref["data"]))
    # A second call finds the extracted files and does nothing: no md5 check, no extraction, no download.
    def untouched(*args, **kwargs):
        raise AssertionError("prepare_cifar100 touched the archive again")
    import torchvision.datasets.utils as tv_utils  # where fetch_cifar100 imports its helpers from
    for name in ("check_integrity", "extract_archive", "download_url"):
        monkeypatch.setattr(tv_utils, name, untouched)
    du.prepare_cifar100(str(tmp_path))


def test_synthetic_has_the_shapes_and_dtypes_of_cifar100(tmp_path):
    write_cifar100(str(tmp_path), 100, 50, archive=False)
    for train in (True, False):
        real = du.load_split("cifar100", str(tmp_path), train)
        fake = du.load_split("synthetic", str(tmp_path), train, size=len(real.labels))
        assert fake.images.dtype == real.images.dtype == torch.uint8
        assert fake.images.shape == real.images.shape
        assert fake.labels.dtype == real.labels.dtype == torch.int64
        assert 0 <= int(fake.labels.min()) and int(fake.labels.max()) < 100
    assert len(du.load_split("synthetic", "", True).labels) == 50_000
    assert len(du.load_split("synthetic", "", False).labels) == 10_000


def test_train_and_test_size_take_the_first_samples(tmp_path):
    write_cifar100(str(tmp_path), 100, 50, archive=False)
    full = du.load_split("cifar100", str(tmp_path), True)
    part = du.load_split("cifar100", str(tmp_path), True, size=30)
    assert torch.equal(part.images, full.images[:30]) and torch.equal(part.labels, full.labels[:30])
    with pytest.raises(UserError, match="--train-size 101 exceeds the 100 samples"):
        du.load_split("cifar100", str(tmp_path), True, size=101)


def test_corrupt_archive_is_refused_before_extraction(tmp_path):
    write_cifar100(str(tmp_path), 20, 10)
    archive = tmp_path / "cifar-100-python.tar.gz"
    with pytest.raises(UserError, match="fails its md5 check.*delete it"):
        du.prepare_cifar100(str(tmp_path))
    assert not (tmp_path / "cifar-100-python").exists()
    assert archive.exists()  # the user's file is left for them to inspect


def test_missing_data_offline_names_the_directory_and_the_archive(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar_archive, "CIFAR100_URL", "http://127.0.0.1:9/cifar-100-python.tar.gz")
    with pytest.raises(UserError) as e:
        du.prepare_cifar100(str(tmp_path / "data"))
    msg = str(e.value)
    assert str(tmp_path / "data") in msg and "cifar-100-python.tar.gz" in msg and "\n" not in msg
    assert os.listdir(tmp_path / "data") == []  # no partial download left behind


def test_pickles_holding_code_are_refused(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (folder / "train").write_bytes(pickle.dumps({"data": Evil(), "fine_labels": []}))
    with pytest.raises(UserError, match="unexpected object"):
        du.load_split("cifar100", str(tmp_path), train=True)
    (folder / "test").write_bytes(b"truncated")
    with pytest.raises(UserError, match="is unreadable"):
        du.load_split("cifar100", str(tmp_path), train=False)
