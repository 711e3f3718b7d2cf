"""Image folders as users have them, read in-process: the splits' classes compared (ImageFolder numbers the
class folders it finds, so a test folder that lacks one, or spells one otherwise, would mislabel every later
class without a word), and dataset_utils.image_folder, the README's reader, on what real folders hold: a Mac's
._ files, notebook checkpoints, empty class folders, images of every PIL mode, 16-bit and EXIF-rotated ones.
(The entry point on such a folder, on 2 ranks: e2e/test_adapt.py.)"""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

import dataset_utils as du
from machinery import bad_samples
from machinery import data_checks, data_names
from machinery.errors import UserError
from machinery.transform_checks import check_transforms


def write_folder(root, classes, per_class=2, size=8):
    """root/<class>/<i>.png: random RGB images, `per_class` of each class."""
    rng = np.random.default_rng(0)
    for c in classes:
        os.makedirs(root / c, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    return root


def plain(root):
    """The README's former reader: torchvision's ImageFolder as it is."""
    data = ImageFolder(str(root), transform=v2.PILToTensor())
    data.mean, data.std = (0.5,) * 3, (0.25,) * 3
    return data


@pytest.mark.parametrize("train_classes, test_classes, named", [
    (["a", "b", "c"], ["a", "c"], "lacks 'b'"),                          # a class with no test images yet
    (["cat", "dog", "emu"], ["cats", "dog", "emu"], "lacks 'cat' and has 'cats'"),  # a typo
    # a letter's case: another order
    (["Dog", "cat", "emu"], ["cat", "dog", "emu"], "lacks 'Dog' and has 'dog'"),
    (["a", "b", "c"], ["a", "b", "c", "d"], "has 'd', which the training split lacks"),
])
def test_a_test_split_that_names_its_classes_otherwise_is_refused_naming_them(tmp_path, train_classes,
                                                                             test_classes, named):
    train, test = (write_folder(tmp_path / "train", train_classes),
                   write_folder(tmp_path / "test", test_classes))
    with pytest.raises(UserError) as e:
        du.measure_data(plain(train), plain(test))
    assert f"the test split's classes are not the training split's: it {named}" in str(e.value)
    fix = ("rename or remove the test split's class folders" if named.startswith("has")
           else "image_folder(path, classes=...)")
    assert fix in str(e.value)


def test_a_test_split_that_lacks_only_the_last_classes_is_taken_and_the_spec_records_the_names(tmp_path):
    train, test = (write_folder(tmp_path / "train", ["a", "b", "c"]),
                   write_folder(tmp_path / "test", ["a", "b"]))
    # every test label means the class it means in training
    spec = du.measure_data(plain(train), plain(test))
    assert spec.num_classes == 3 and spec.classes == ("a", "b", "c")


def test_a_test_split_numbered_by_hand_with_the_training_class_to_idx_is_taken(tmp_path):
    train, test = (plain(write_folder(tmp_path / "train", ["a", "b", "c"])),
                   plain(write_folder(tmp_path / "test", ["a", "c"])))
    test.samples = [(path, train.class_to_idx[os.path.basename(os.path.dirname(path))])
                    for path, _ in test.samples]
    # .classes as found
    test.class_to_idx, test.targets = dict(train.class_to_idx), [label for _, label in test.samples]
    assert du.measure_data(train, test).classes == ("a", "b", "c")


def test_image_folder_numbers_a_test_split_by_the_training_classes(tmp_path):
    write_folder(tmp_path / "train", ["a", "b", "c"])
    write_folder(tmp_path / "test", ["a", "c"])
    classes = du.folder_classes(tmp_path / "train")
    train, test = du.image_folder(tmp_path / "train", classes), du.image_folder(tmp_path / "test", classes)
    assert test.classes == ["a", "b", "c"] and test.targets == [0, 0, 2, 2]  # c is 2, as in training
    train.mean, train.std = (0.5,) * 3, (0.25,) * 3
    assert du.measure_data(train, test).num_classes == 3


def test_image_folder_leaves_out_hidden_files_and_folders_and_says_so(tmp_path, capsys):
    root = write_folder(tmp_path / "train", ["a", "b"])
    # AppleDouble: metadata, not an image
    (root / "a" / "._0.png").write_bytes(b"\x00\x05\x16\x07Mac OS X        ")
    (root / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (root / "b" / ".ipynb_checkpoints").mkdir()
    Image.new("RGB", (8, 8)).save(root / "b" / ".ipynb_checkpoints" / "0-checkpoint.png")
    (root / ".ipynb_checkpoints").mkdir()  # at the top: plain ImageFolder would make it a class
    Image.new("RGB", (8, 8)).save(root / ".ipynb_checkpoints" / "x.png")
    (root / "a" / "notes.txt").write_text("not an image")
    data = du.image_folder(root)
    assert data.classes == ["a", "b"] and len(data) == 4
    assert (sorted(os.path.relpath(path, root) for path, _ in data.samples)
            == ["a/0.png", "a/1.png", "b/0.png", "b/1.png"])
    # a/._0.png and b/.ipynb_checkpoints/0-checkpoint.png; the top-level ones are no class, so never read
    assert f"{root}: left out 2 hidden files (names that start with '.', such as " in capsys.readouterr().out


def test_image_folder_refuses_an_empty_class_folder_and_a_class_folder_not_among_the_training_classes(
        tmp_path):
    root = write_folder(tmp_path / "train", ["a", "b"])
    (root / "c").mkdir()
    (root / "c" / "scan.heic").write_bytes(b"")  # a file, but not of an image type ImageFolder reads
    with pytest.raises(UserError, match=f"the class folder {root}/c holds no image file .*: give it its "
                                        f"images, or remove it"):
        du.image_folder(root)
    test = write_folder(tmp_path / "test", ["a", "B"])
    with pytest.raises(UserError, match=f"{test} holds the class folder\\(s\\) 'B', not among the training classes"):
        du.image_folder(test, classes=["a", "b"])
    with pytest.raises(UserError, match="cannot read the image folder .*/nowhere"):
        du.folder_classes(tmp_path / "nowhere")


def test_image_folder_reads_l_rgba_p_1_bit_cmyk_16_bit_and_exif_rotated_images_as_they_look(tmp_path):
    root = tmp_path / "train" / "a"
    root.mkdir(parents=True)
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
    # 16 bits: the same greys, scaled
    Image.fromarray(grey.astype(np.uint16) * 257).save(root / "0_16bit.png")
    rgb = Image.fromarray(np.stack([grey] * 3, axis=-1))
    for mode in ("L", "RGBA", "P", "1", "CMYK"):
        rgb.convert(mode).save(root / f"1_{mode}.{'jpg' if mode == 'CMYK' else 'png'}")
    # stored 4 wide, 8 high; EXIF: turn it 90 degrees
    tall = Image.fromarray(np.zeros((8, 4, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    tall.save(root / "2_exif.jpg", exif=exif)
    data = du.image_folder(tmp_path / "train")
    images = {os.path.basename(path): data[i][0] for i, (path, _) in enumerate(data.samples)}
    assert all(x.dtype == torch.uint8 and x.shape[0] == 3 for x in images.values())
    assert torch.equal(images["0_16bit.png"][0], torch.from_numpy(grey))  # not clipped to white
    assert images["2_exif.jpg"].shape == (3, 4, 8)  # as a viewer shows it: 8 wide, 4 high
    assert du.image_folder(tmp_path / "train", mode="L")[0][0].shape == (1, 8, 8)


def test_a_mac_appledouble_file_read_by_a_plain_image_folder_is_named_with_the_way_out(tmp_path):
    root = write_folder(tmp_path / "train", ["a"])
    (root / "a" / "._0.png").write_bytes(b"\x00\x05\x16\x07Mac OS X        ")
    data = plain(root)
    bad = bad_samples.read_sample(data, [os.path.basename(p) for p, _ in data.samples].index("._0.png"),
                                  "training")
    assert isinstance(bad, bad_samples.BadSample) and bad.file.endswith("a/._0.png")
    assert bad.fix.startswith("it is a Mac's AppleDouble metadata file, not an image: delete them (find ")
    assert "-name '._*' -delete), or use dataset_utils.image_folder" in bad.fix
    # A ._ file beside every image: they sort first, so none of a class folder's first samples reads.
    for i in range(1, 12):
        Image.new("RGB", (8, 8)).save(root / "a" / f"{i:02d}.png")
        (root / "a" / f"._{i:02d}.png").write_bytes(b"\x00\x05\x16\x07Mac OS X        ")
    with pytest.raises(UserError, match="none of its first 10 samples reads; the last: training sample 9 "
                                        ".*/a/._.*it is a Mac's AppleDouble metadata file, not an image: "
                                        "delete them"):
        du.check_split(plain(root), "training")


def test_a_broken_symbolic_link_is_named_as_one_with_its_target(tmp_path):
    root = write_folder(tmp_path / "train", ["a"])
    (root / "a" / "2.png").symlink_to(tmp_path / "moved" / "2.png")  # ImageFolder lists it; reading it fails
    data = du.image_folder(root)
    bad = bad_samples.read_sample(data, [os.path.basename(p) for p, _ in data.samples].index("2.png"),
                                  "training")
    assert bad.reason.startswith("FileNotFoundError") and bad.file.endswith("a/2.png")
    assert bad.fix == (f"it is a symbolic link to {tmp_path}/moved/2.png, which does not exist: restore "
                       "that file, or remove the link")


def test_mean_std_of_a_dataset_is_exact_over_all_or_over_an_even_sample():
    """dataset_utils.mean_std, the README's folder reader's statistics: the integer-exact statistics of the
    images it reads (measure_data's channel_stats of the same images stacked), all of them or every k-th."""
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(30, 3, 5, 7, generator=g)
              * torch.tensor([50.0, 150.0, 255.0]).view(1, 3, 1, 1)).to(torch.uint8)
    items = [(image, 0) for image in images]
    assert du.mean_std(items, samples=0) == data_checks.channel_stats(images)
    assert du.mean_std(items, samples=10) == data_checks.channel_stats(images[0::3])  # 10 of 30: every third
    assert du.mean_std(items, samples=10) != data_checks.channel_stats(images)



def test_image_folder_samples_keeps_n_images_spread_evenly_over_every_class_and_refuses_more_than_it_holds(tmp_path):
    """samples=N (the README passes --train-size, --test-size): N of the sorted files, every k-th, so every class
    keeps its share (the first N would be the first classes alone), the same each time; more than it holds: refused."""
    root = write_folder(tmp_path / "train", ["a", "b", "c"], per_class=4, size=4)
    whole, kept = du.image_folder(root), du.image_folder(root, samples=6)
    assert len(kept) == 6 and kept.samples == [whole.samples[i] for i in (0, 2, 4, 6, 8, 10)]
    assert kept.targets == [0, 0, 1, 1, 2, 2] and kept.classes == ["a", "b", "c"]
    assert du.image_folder(root, samples=6).samples == kept.samples
    with pytest.raises(UserError, match=r"train holds 12 images, fewer than the 13 asked \(--train-size or "):
        du.image_folder(root, samples=13)


def test_the_data_line_gives_the_size_range_of_the_images_mean_std_read_else_the_first_image_s_size_as_such(tmp_path):
    """Images of 12, 14 and 16 pixels a side (the first 14): the range, once mean_std has read them all; the range
    and how many it read, from a sample; a Dataset it did not read: the first image's size, said as the first's."""
    root = tmp_path / "digits"
    for i, side in enumerate((14, 12, 16, 14, 12, 16)):
        (root / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("L", (side + i % 2, side)).save(root / f"d{i % 2}" / f"{i}.png")
    data = du.image_folder(root, mode="L")

    def describe_sizes(split, channels):
        return data_names.check_sizes(SimpleNamespace(train_size=0, test_size=0), split, None, channels)
    assert describe_sizes(data, 1) == "1 x 14 x 14 (the first)"
    du.mean_std(data, samples=0)
    assert describe_sizes(data, 1) == "1 x 12..16 x 12..17"
    du.mean_std(data, samples=2)  # files 0 and 3: 14 x 14 and 12 x 13
    assert describe_sizes(data, 1) == "1 x 12..14 x 13..14 (in the 2 of 6 read)"
    assert describe_sizes(du.ImageData(torch.zeros(2, 3, 5, 7, dtype=torch.uint8), torch.zeros(2).long()),
                          3) == "3 x 5 x 7"


def test_a_size_flag_load_data_did_not_take_is_named_in_a_note(tmp_path, capsys):
    """A load_data that returns all its samples though --train-size or --test-size asked for fewer: a note each."""
    split = du.ImageData(torch.zeros(10, 1, 4, 4, dtype=torch.uint8), torch.zeros(10).long())
    data_names.check_sizes(SimpleNamespace(train_size=4, test_size=10), split, split, 1)
    data_names.check_sizes(SimpleNamespace(train_size=0, test_size=0), split, split, 1)
    assert capsys.readouterr().out == (
        "note: --train-size 4 does nothing here: load_data returned 10 samples; take the first cfg.train_size in "
        "load_data (dataset_utils.image_folder: samples=cfg.train_size)\n")


def test_the_records_call_the_data_of_dataset_by_its_name_and_any_other_data_by_their_source(tmp_path):
    """What load_split reads is --dataset's data (the records keep its name); anything else load_data returns is
    named by its source, as the Data line names it."""
    from support import write_cifar100
    write_cifar100(str(tmp_path), 4, 2, archive=False)
    for dataset in ("synthetic", "cifar100"):
        source = du.describe_source(du.load_split(dataset, str(tmp_path), True, 2))
        assert data_names.records_name(dataset, str(tmp_path), source) == dataset
    folder = du.describe_source(du.image_folder(write_folder(tmp_path / "f", "ab")))
    assert data_names.records_name("cifar100", str(tmp_path), folder) == folder == f"ImageFolderSplit of {tmp_path}/f"
    assert data_names.records_name("cifar100", str(tmp_path), "Fashion-MNIST in x") == "Fashion-MNIST in x"


def test_image_folder_resizes_images_of_other_sizes_to_the_size_asked(tmp_path):
    for name, (w, h) in (("a", (12, 9)), ("b", (5, 7))):  # PIL's (width, height)
        (tmp_path / name).mkdir()
        Image.new("RGB", (w, h), (200, 10, 10)).save(tmp_path / name / "x.png")
    data = du.image_folder(tmp_path, size=(8, 6))
    assert [tuple(data[i][0].shape) for i in range(2)] == [(3, 8, 6), (3, 8, 6)]
    assert data[0][0][:, 4, 3].tolist() == [200, 10, 10]  # resized, not cropped or padded
    assert tuple(du.image_folder(tmp_path, size=5)[1][0].shape) == (3, 5, 5)
    assert [tuple(du.image_folder(tmp_path)[i][0].shape) for i in range(2)] == [(3, 9, 12), (3, 7, 5)]  # as stored


def default_crop(h, w):
    """train_ddp.build_transforms' default for h x w images: a crop back to that size."""
    return v2.Compose([v2.RandomCrop((h, w), padding=[w // 8, h // 8]), v2.RandomHorizontalFlip()])


def test_splits_of_two_sizes_without_a_test_transform_are_refused_naming_the_way_out_that_fits_the_data(tmp_path):
    """Image folders: the reader's size= (the README's fix); tensors load_data builds (ImageData): a resize of them;
    either: a test transform. Each names the size the training transform gives. Two sizes alone are no error:
    load_data's splits are measured (measure_data) before the transforms make them the model's size."""
    for split, (w, h) in (("train", (40, 36)), ("test", (44, 40))):  # PIL's (width, height)
        for name in ("a", "b"):
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (w, h), (200, 10, 10)).save(tmp_path / split / name / "x.png")
    classes = du.folder_classes(tmp_path / "train")
    folders = SimpleNamespace(train=du.image_folder(tmp_path / "train", classes),
                              test=du.image_folder(tmp_path / "test", classes))
    folders.train.mean, folders.train.std = (0.5,) * 3, (0.25,) * 3
    spec = du.measure_data(folders.train, folders.test)
    assert (spec.height, spec.width) == (36, 40)
    with pytest.raises(UserError) as refused:
        check_transforms(folders, default_crop(36, 40), None)
    assert str(refused.value) == (
        "the training transform (build_transforms in train_ddp.py) gives images of 3 x 36 x 40 but the test images "
        "(no test transform) of 3 x 40 x 44: the model takes one size: size=(36, 40) in "
        "both dataset_utils.image_folder calls of load_data; or a test transform giving it (e.g. v2.Resize(36) and "
        "v2.CenterCrop((36, 40)))")
    assert check_transforms(folders, default_crop(36, 40), v2.Compose([v2.Resize(36), v2.CenterCrop((36, 40))])
                            ) == (3, 36, 40)
    # read with the reader's fix: one shape
    assert {tuple(du.image_folder(tmp_path / split, classes, size=(36, 40))[0][0].shape)
            for split in ("train", "test")} == {(3, 36, 40)}

    def tensors(h, w):
        return du.ImageData(torch.zeros(2, 3, h, w, dtype=torch.uint8), torch.tensor([0, 1]))
    with pytest.raises(UserError) as in_memory:
        check_transforms(SimpleNamespace(train=tensors(36, 40), test=tensors(40, 44)), default_crop(36, 40), None)
    assert "resize both splits' images to (36, 40) in load_data" in str(in_memory.value)
    assert "image_folder" not in str(in_memory.value)
    with pytest.raises(UserError, match="both splits must have one number of channels; give both 3 in load_data"):
        du.measure_data(tensors(36, 40), du.ImageData(torch.zeros(2, 1, 36, 40, dtype=torch.uint8),
                                                      torch.tensor([0, 1])))


def test_an_image_of_another_size_in_a_folder_is_named_with_the_reader_s_size_as_the_way_out(tmp_path):
    for name, (w, h) in (("a", (16, 16)), ("b", (20, 18))):
        (tmp_path / name).mkdir()
        Image.new("RGB", (w, h), (200, 10, 10)).save(tmp_path / name / "x.png")
    bad = bad_samples.read_sample(du.image_folder(tmp_path), 1, "training", (3, 16, 16))
    assert bad.fix == ("make every image 3 x 16 x 16: size=(16, 16) in both dataset_utils.image_folder calls of "
                       "load_data")


def test_photos_of_any_size_become_the_model_s_size_through_the_transforms_and_one_that_does_not_is_named(tmp_path):
    """No resize in load_data: the training transform (RandomResizedCrop) and the test one (Resize, CenterCrop)
    make every photo the model's size. Where the transform does not (Resize alone, on a photo of another aspect) or
    fails (a crop larger than the photo), the sample is bad, named by its file, the transform and what it did."""
    sizes = [(30, 20), (17, 33), (40, 40), (25, 25), (64, 48)]  # PIL's (width, height)
    for i, size in enumerate(sizes):
        (tmp_path / f"c{i % 2}").mkdir(exist_ok=True)
        Image.new("RGB", size, (10 * i, 100, 200)).save(tmp_path / f"c{i % 2}" / f"{i}.png")
    folder = du.image_folder(tmp_path)
    train = v2.Compose([v2.RandomResizedCrop(16, scale=(0.5, 1)), v2.RandomHorizontalFlip()])
    test = v2.Compose([v2.Resize(16), v2.CenterCrop(16)])
    assert check_transforms(SimpleNamespace(train=folder, test=folder), train, test) == (3, 16, 16)
    for split, transform in (("training", train), ("test", test)):
        dataset = du.ImageDataset(folder, transform=transform, split=split, shape=(3, 16, 16))
        assert [tuple(dataset[i][0].shape) for i in range(len(sizes))] == [(3, 16, 16)] * len(sizes)

    def bad(transform, split="test"):
        index = next(i for i, (path, _) in enumerate(folder.samples) if path.endswith("1.png"))  # 17 x 33
        found = du.ImageDataset(folder, transform=transform, split=split, shape=(3, 16, 16))[index]
        assert isinstance(found, bad_samples.BadSample) and found.file.endswith("1.png"), found
        return found

    resized = bad(v2.Resize(16))
    assert resized.reason == ("the test transform (build_transforms in train_ddp.py) returned 3 x 31 x 16 uint8 "
                              "for its 3 x 33 x 17 uint8 image, not the model's 3 x 16 x 16 uint8")
    assert resized.fix == "make it return 3 x 16 x 16 uint8 for every image (e.g. end with v2.Resize(16) and " \
                          "v2.CenterCrop((16, 16)))"
    failed = bad(v2.RandomCrop(20), "training")
    assert failed.reason.startswith("the training transform (build_transforms in train_ddp.py) failed on its "
                                    "3 x 33 x 17 uint8 image: ValueError: "), failed.reason
    # data held in memory are not skipped: the same said as the error
    with pytest.raises(UserError, match=r"^training sample 4: the training transform .* returned 3 x 16 x 21 uint8"):
        bad_samples.transform_image(v2.Resize(16), torch.zeros(3, 30, 40, dtype=torch.uint8), idx=4,
                                    split="training", shape=(3, 16, 16), seed=0)
