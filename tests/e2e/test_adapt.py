"""Adapting the reference: another image-classification dataset is `load_data` alone, another model is
`build_model` with `model_config` alone. Each test copies train_ddp.py, replaces exactly those
functions (the Fashion-MNIST one with the README's own text), and runs the copy on forked ranks (torchrun
for the README's command and a refusal's ending: run_adapted), or in the test's process where neither the
world size nor the process is the point (support.run_in_process)."""
import gzip
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

import dataset_utils as du
from support import (ROOT, SCRIPTS, TINY, assert_one_line, launch, launch_forked,
                     load_model_state, read_json, read_jsonl, run_in_process, torchrun_root_cause)

FASHION = "/usr/share/datasets/fashion-mnist"
FASHION_FILES = [f"{split}-{kind}-idx{d}-ubyte.gz"
                 for split in ("train", "t10k") for kind, d in (("images", 3), ("labels", 1))]


def readme_load_data(marker: str) -> str:
    """The python block the README shows after `<!-- {marker}: the tests replace load_data with exactly this
    block -->` ("worked example": Fashion-MNIST's; "image folders"), exactly as written there."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    after = text.split(f"<!-- {marker}: the tests replace load_data with exactly this block -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def adapted_script(folder, **functions) -> str:
    """train_ddp.py with the named top-level functions replaced by the given source, written to
    folder/train_ddp.py; it imports the project's other modules through PYTHONPATH (ADAPTED_ENV)."""
    src = open(os.path.join(ROOT, "train_ddp.py")).read()
    for name, new in functions.items():
        start = src.index(f"\ndef {name}(") + 1
        # the next top-level line
        end = re.compile(r"^\S", re.M).search(src, src.index("\n", start) + 1).start()
        src = src[:start] + new.strip("\n") + "\n\n\n" + src[end:]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "train_ddp.py")
    with open(path, "w") as f:
        f.write(src)
    return path


ADAPTED_ENV = {"PYTHONPATH": ROOT}


def run_adapted(script, args, nproc=2, check=True, env=None, torchrun=False, fast_exit=True):
    """The adapted script on nproc ranks: forked (support.launch_forked), or under torchrun where the launcher
    is part of the point (a failing run's ending, the README's command: fast_exit=False, a user's exit)."""
    env = {**ADAPTED_ENV, **(env or {})}
    if torchrun:
        return launch(args, nproc=nproc, script=script, env=env, check=check, timeout=900, fast_exit=fast_exit)
    return launch_forked(args, nproc=nproc, script=script, env=env, check=check, timeout=900)


def require_fashion_mnist():
    missing = [f for f in FASHION_FILES if not os.path.isfile(os.path.join(FASHION, f))]
    if missing:
        hint = (f"Fashion-MNIST is not in {FASHION}: apt-get update && apt-get install -y "
                f"dataset-fashion-mnist")
        if os.environ.get("CI") == "true":
            pytest.fail(hint)
        pytest.skip(hint)


def read_idx(path) -> torch.Tensor:
    """The test's own reader of an idx file, independent of the README's."""
    with gzip.open(path) as f:
        raw = f.read()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8).view(shape)


# --------------------------------------------------------------------------- the README's worked example

# What the README's command runs: WRN-10-1, the paper's LR per 128 samples, 3 epochs of all 60,000 images.
FASHION_RUN = ["--data-dir", FASHION, *TINY, "--batch-size", 128, "--base-lr", 0.1,
               "--reference-batch-size", 128, "--epochs", 3, "--log-every", 0]


def test_readme_fashion_mnist_example_learns_resumes_and_evaluates(tmp_path):
    require_fashion_mnist()
    block = readme_load_data("worked example")
    assert block.startswith("def load_data(") and "ImageData" in block
    script = adapted_script(tmp_path / "code", load_data=block)
    out = tmp_path / "run"
    first = run_adapted(script, [*FASHION_RUN, "--out-dir", out, "--stop-after-epoch", 1], torchrun=True,
                        fast_exit=False)
    assert (f"Data: Fashion-MNIST in {FASHION}: 60000 training and 10000 test images of 1 x 28 x 28, "
            f"10 classes" in first.stdout)
    # not cifar100
    assert read_json(os.path.join(out, "config.json"))["data"] == f"Fashion-MNIST in {FASHION}"
    assert "Stopping after epoch 1 as asked" in first.stdout
    second = run_adapted(script, [*FASHION_RUN, "--out-dir", out], torchrun=True, fast_exit=False)
    assert "Resumed from" in second.stdout and "Training completed successfully." in second.stdout

    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    assert all(m["train_samples"] == 60_000 and m["val_count"] == 10_000 for m in metrics)
    final = metrics[-1]
    print(f"Fashion-MNIST, 2 ranks: top-1 {final['val_acc']:.4f} after "
          f"{sum(m['epoch_time_s'] for m in metrics):.0f} s of training")
    assert final["val_acc"] >= 0.85

    # The data described themselves: 1 channel of 28 x 28, 10 classes, and the training set's statistics
    # (Fashion-MNIST's known 0.2860 and 0.3530), in config.json and in the checkpoint.
    images = read_idx(os.path.join(FASHION, "train-images-idx3-ubyte.gz")).double() / 255
    spec = read_json(out / "config.json")["data_spec"]
    assert (spec["channels"], spec["height"], spec["width"], spec["num_classes"]) == (1, 28, 28, 10)
    assert spec["mean"][0] == pytest.approx(images.mean().item(), abs=1e-9) == pytest.approx(0.2860, abs=1e-4)
    assert spec["std"][0] == pytest.approx(images.std(unbiased=False).item(), abs=1e-9)
    ckpt = load_model_state(out)
    assert json.loads(json.dumps(ckpt["config"]["data_spec"])) == spec  # tuples there, lists in JSON
    assert ckpt["model_config"] == {"name": "WRN-10-1", "depth": 10, "widen_factor": 1, "in_channels": 1,
                                    "num_classes": 10}
    assert ckpt["model"]["conv1.weight"].shape[1] == 1 and ckpt["model"]["fc.weight"].shape[0] == 10

    # on another world size, 1 process (in this one)
    ev = run_in_process(["--evaluate", "--out-dir", out, "--timeout", 120, "--workers", 0], script=script,
                        check=True)
    assert ("Evaluating" in ev.stdout
            and "(WRN-10-1 with 10 classes, 3 of 3 epochs trained) on 10000 test images" in ev.stdout)
    result = read_json(out / "eval.json")
    assert result["val_count"] == 10_000 and result["val_acc"] == final["val_acc"]


# --------------------------------------------------------------------------- other shapes and class counts

SHAPED_LOAD_DATA = '''
def load_data(cfg, env, train: bool = True):
    """Generated {c} x {h} x {w} images of {k} classes: a level per channel and a stripe per class, plus noise."""
    fixed = torch.Generator().manual_seed(7)  # the class patterns, shared by both splits
    level = torch.rand({k}, {c}, 1, 1, generator=fixed) * 150 + 50
    rows, cols = torch.meshgrid(torch.arange({h}.0), torch.arange({w}.0), indexing="ij")
    freq = torch.randint(1, 4, ({k}, 1, 1), generator=fixed)
    stripes = 40 * torch.sin(2 * torch.pi * freq * (rows / {h} + cols / {w}))

    def split(n, seed):
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, {k}, (n,), generator=g)
        images = level[labels] + stripes[labels][:, None] + 20 * torch.randn(n, {c}, {h}, {w}, generator=g)
        return dataset_utils.ImageData(images.round().clamp(0, 255).to(torch.uint8), labels)

    return (split(480, 1) if train else None), split(150, 2)
'''

SHAPES = {"non-square RGB": (3, 24, 40, 7), "grey": (1, 20, 20, 5)}
SHAPED_RUN = [*TINY, "--batch-size", 32, "--base-lr", 0.2, "--reference-batch-size", 32, "--warmup-epochs", 0,
              "--epochs", 3, "--device", "cpu", "--log-every", 0]


def shaped_block(c, h, w, k) -> str:
    return SHAPED_LOAD_DATA.format(c=c, h=h, w=w, k=k)


def generated_split(block, train: bool):
    """What the block's load_data returns, run here, apart from the script."""
    scope = {"torch": torch, "dataset_utils": du}
    exec(block, scope)
    return scope["load_data"](None, None, train)


@pytest.mark.parametrize("loader", ["torch", "gpu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_load_data_alone_adapts_to_another_shape_and_class_count(tmp_path, shape, loader):
    c, h, w, k = SHAPES[shape]
    block = shaped_block(c, h, w, k)
    script = adapted_script(tmp_path / "code", load_data=block)
    out = tmp_path / "run"
    # one process, in this one: the shape and the classes are the point, not the world size
    proc = run_in_process([*SHAPED_RUN, "--out-dir", out, "--loader", loader], script=script, check=True)
    assert (f"Data: ImageData from load_data: 480 training and 150 test images of {c} x {h} x {w}, "
            f"{k} classes" in proc.stdout)
    assert ("Validation Top-5 Accuracy" in proc.stdout) == (k > 5)  # with 5 classes or fewer it is always 1
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["train_samples"] == 480 and m["val_count"] == 150 for m in metrics)
    assert metrics[-1]["val_acc"] >= 0.6, metrics  # chance is 1/k: it learned from images of this shape
    train, _ = generated_split(block, True)
    mean = (train.images.double().mean(dim=(0, 2, 3)) / 255).tolist()
    spec = read_json(out / "config.json")["data_spec"]
    assert (spec["channels"], spec["height"], spec["width"], spec["num_classes"]) == (c, h, w, k)
    assert spec["mean"] == pytest.approx(mean, abs=1e-9)
    ckpt = load_model_state(out)
    assert ckpt["model"]["conv1.weight"].shape[1] == c and ckpt["model"]["fc.weight"].shape[0] == k


def test_resume_on_data_of_another_shape_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    rgb = adapted_script(tmp_path / "rgb", load_data=shaped_block(*SHAPES["non-square RGB"]))
    run_in_process([*SHAPED_RUN, "--out-dir", out, "--epochs", 1], script=rgb, check=True)
    before = (out / "checkpoint.pt").read_bytes()
    grey = adapted_script(tmp_path / "grey", load_data=shaped_block(*SHAPES["grey"]))
    proc = run_in_process([*SHAPED_RUN, "--out-dir", out, "--epochs", 2], script=grey)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    assert (f"load_data gives 1 x 20 x 20 images of 5 classes, but the checkpoint in {out} was trained on "
            f"3 x 24 x 40 images of 7 classes: use another --out-dir") in errors[0]
    assert (out / "checkpoint.pt").read_bytes() == before


# --------------------------------------------------------------------------- a Dataset of image files

FOLDER_LOAD_DATA = '''
def load_data(cfg, env, train: bool = True):
    """An ImageFolder of PNG files under --data-dir/{train,test}, read by the DataLoader's workers."""
    import os
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    def folder(name):  # PIL reads the files as RGB: one grey channel back, as uint8 C x H x W
        data = ImageFolder(os.path.join(cfg.data_dir, name), transform=v2.Compose([v2.Grayscale(), v2.PILToTensor()]))
        data.mean, data.std = (0.286,), (0.353,)  # stated: computing them would read every file
        return data

    return (folder("train") if train else None), folder("test")
'''


def write_fashion_pngs(root, n_train: int, n_test: int, to_image=None):
    """Real Fashion-MNIST's first n_train training and n_test test images as PNG files,
    root/{train,test}/class_<label>/<i:05d>.png; `to_image(image, first)` makes each PIL image from the uint8 tensor
    (first: the first of its class folder), by default the image as it is."""
    require_fashion_mnist()
    from PIL import Image
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = read_idx(os.path.join(FASHION, f"{prefix}-images-idx3-ubyte.gz"))[:n]
        labels = read_idx(os.path.join(FASHION, f"{prefix}-labels-idx1-ubyte.gz"))[:n]
        for i, (image, label) in enumerate(zip(images, labels)):
            folder = root / split / f"class_{label}"
            first = not folder.is_dir()
            folder.mkdir(parents=True, exist_ok=True)
            (to_image(image, first) if to_image else Image.fromarray(image.numpy())).save(folder / f"{i:05d}.png")
    return root


@pytest.fixture(scope="module")
def png_folder(tmp_path_factory):
    """600 training and 200 test images of real Fashion-MNIST, as PNG files in an ImageFolder."""
    return write_fashion_pngs(tmp_path_factory.mktemp("pngs"), 600, 200)


def test_image_folder_loader_yields_every_sample_once_per_epoch(tmp_path, png_folder):
    out = tmp_path / "record.json"
    launch_forked([png_folder, out, 32, 2, 1, "imagefolder"], nproc=2, script=f"{SCRIPTS}/record_batches.py")
    record = json.loads(out.read_text())
    for epoch in ("1", "2"):
        assert len({s["steps"] for s in record[epoch]}) == 1
        assert sorted(i for s in record[epoch] for i in s["ids"]) == list(range(600))
    assert record["1"][0]["ids"] != record["2"][0]["ids"]


# 600 / 32: 19 steps per epoch, the last short; dropout, so that the RNG state matters; a loader worker per rank
# where launched (the runs in the test's process give --workers 0).
FOLDER_RUN = [*TINY, "--batch-size", 32, "--epochs", 2, "--dropout", 0.1, "--workers", 1, "--loader", "torch",
              "--device", "cpu", "--log-every", 0]


def test_image_folder_dataset_trains_evaluates_exactly_and_resumes_mid_epoch_exactly(tmp_path, png_folder):
    """The training, its stop and its resume in one process, in this one, reading the files itself; the
    evaluation on 3 ranks, each with a loader worker that reads the files. (A Dataset of files stopped
    mid-epoch and resumed exactly on 2 ranks, a loader worker each: e2e/test_diagnostics.py's skipped
    samples.)"""
    script = adapted_script(tmp_path / "code", load_data=FOLDER_LOAD_DATA)
    run = [*FOLDER_RUN, "--data-dir", png_folder, "--workers", 0]
    reference = tmp_path / "reference"
    proc = run_in_process([*run, "--out-dir", reference], script=script, check=True)
    assert (": 600 training and 200 test images of 1 x 28 x 28 (the first), 10 classes; per-channel mean (0.286,)"
            in proc.stdout)
    metrics = read_jsonl(reference / "metrics.jsonl")
    assert all(m["train_samples"] == 600 and m["val_count"] == 200 for m in metrics)

    # A stop request at the first check (step 10 of 19), then the same command: the weights of the
    # uninterrupted run, bit for bit.
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    stop_file.touch()
    stop_env = {"DDP_STOP_FILE": str(stop_file)}
    stopped = run_in_process([*run, "--out-dir", out], script=script, env=stop_env)
    assert stopped.returncode == 75 and "Stop requested (stop file" in stopped.stdout
    assert load_model_state(out)["progress"]["position"] == 320  # 10 steps of 32: mid-epoch
    stop_file.unlink()
    resumed = run_in_process([*run, "--out-dir", out], script=script, env=stop_env, check=True)
    assert "and 320 samples (10 steps) of the next." in resumed.stdout
    got, want = load_model_state(out), load_model_state(reference)
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    assert read_jsonl(out / "metrics.jsonl")[-1]["val_acc"] == metrics[-1]["val_acc"]

    # Exact evaluation on another world size (3, which does not divide 200), the files read by a loader worker
    # per rank: each image once, the same score as in training.
    run_adapted(script, ["--evaluate", "--out-dir", reference, "--workers", 1, "--timeout", 120], nproc=3)
    result = read_json(reference / "eval.json")
    assert result["val_count"] == 200 and result["val_acc"] == metrics[-1]["val_acc"]

    # A Dataset is read by the DataLoader's workers: --loader gpu, which holds the data on the device, refuses
    # it.
    refused = run_in_process([*run, "--out-dir", tmp_path / "gpu", "--loader", "gpu"], script=script)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert (refused.returncode != 0 and len(errors) == 1
            and "--loader gpu needs the data in memory" in errors[0])


# --------------------------------------------------------------------------- a real folder, as users have it

# torchvision's ImageFolder as it is (RGB): what a user writes without the README's reader.
PLAIN_FOLDER_LOAD_DATA = (FOLDER_LOAD_DATA
                          .replace("v2.Compose([v2.Grayscale(), v2.PILToTensor()])", "v2.PILToTensor()")
                          .replace("(0.286,), (0.353,)", "(0.286,) * 3, (0.353,) * 3"))
APPLEDOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        "  # the header of a Mac's ._ file


@pytest.fixture(scope="module")
def messy_folder(png_folder, tmp_path_factory):
    """png_folder as real folders come: unpacked from a Mac's tar (a ._ file beside each image of class_0),
    with .DS_Store files and a notebook's checkpoints; some images greyscale with alpha, palette or 16-bit;
    and a test folder that lacks class_3 (no test images of it yet)."""
    from PIL import Image
    root = tmp_path_factory.mktemp("messy")
    shutil.copytree(png_folder, root, dirs_exist_ok=True)
    shutil.rmtree(root / "test" / "class_3")
    for png in sorted((root / "train" / "class_0").glob("*.png")):
        (png.parent / f"._{png.name}").write_bytes(APPLEDOUBLE)
    for split in ("train", "test"):
        (root / split / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (root / "train" / "class_2" / ".ipynb_checkpoints").mkdir()
    Image.new("L", (28, 28)).save(root / "train" / "class_2" / ".ipynb_checkpoints" / "00000-checkpoint.png")
    for i, png in enumerate(sorted((root / "train" / "class_1").glob("*.png"))[:3]):
        grey = Image.open(png)
        converted = [grey.convert("LA"), grey.convert("P"),
                     Image.fromarray((np.asarray(grey).astype(np.uint16) * 257))]
        converted[i].save(png)
    return root


def test_a_real_folder_trains_with_the_readme_s_reader_and_a_plain_image_folder_is_refused_in_one_line(
        tmp_path, messy_folder):
    """The README's load_data for image folders: the ._ files and checkpoints left out and counted, every mode
    read, the test images of each class labelled as in training though class_3 has none; then a plain
    ImageFolder on the same folders, which would shift class_4 to class_9 down by one, is refused on 2 ranks
    before any training, and so is --evaluate of the trained checkpoint with it (in one process)."""
    hidden = len(list((messy_folder / "train" / "class_0").glob("._*"))) + 1
    n_test = sum(1 for _ in (messy_folder / "test").glob("*/*.png"))
    out = tmp_path / "run"
    readme = adapted_script(tmp_path / "readme", load_data=readme_load_data("image folders"))
    # the reader is the point: one process, in this one (the same reader's files read by a loader worker on
    # 2 ranks, trained on, stopped and resumed: e2e/test_diagnostics.py's skipped samples)
    proc = run_in_process([*FOLDER_RUN, "--epochs", 1, "--workers", 0, "--data-dir", messy_folder,
                           "--out-dir", out], script=readme, check=True)
    assert f"{messy_folder}/train: left out {hidden} hidden files (names that start with '.'" in proc.stdout
    assert (f"Data: ImageFolderSplit of {messy_folder}/train: 600 training and {n_test} test images of "
            f"3 x 28 x 28, 10 classes" in proc.stdout)
    assert read_json(out / "config.json")["data_spec"]["classes"] == [f"class_{k}" for k in range(10)]
    assert read_jsonl(out / "metrics.jsonl")[0]["val_count"] == n_test < 200

    plain = adapted_script(tmp_path / "plain", load_data=PLAIN_FOLDER_LOAD_DATA)
    for args, source, nproc in (([*FOLDER_RUN, "--data-dir", messy_folder, "--out-dir", tmp_path / "plain"],
                                 "the training split's", 2),
                                (["--evaluate", "--out-dir", out, "--timeout", 60, "--workers", 0],
                                 "the checkpoint's training split's", 1)):
        refused = (run_adapted(plain, args, check=False, torchrun=True) if nproc == 2
                   else run_in_process(args, script=plain))
        assert refused.returncode != 0 and "Training started" not in refused.stdout
        assert_one_line(refused.stdout + refused.stderr, f"error: the test split's classes are not {source}: "
                                                         "it lacks 'class_3', so its labels would name other "
                                                         "classes")


def test_an_image_folder_changed_between_a_run_and_its_resume_is_refused_on_every_rank(tmp_path, png_folder):
    """The README's reader on 2 ranks, where rank 0 lists the folder and the other takes its list: one training image
    removed after the run changes the resume's list, and so the data's fingerprint: refused in one line, every rank
    out, the checkpoint kept."""
    folder, out = tmp_path / "pngs", tmp_path / "run"
    shutil.copytree(png_folder, folder)
    script = adapted_script(tmp_path / "code", load_data=readme_load_data("image folders"))
    run = [*FOLDER_RUN, "--workers", 0, "--data-dir", folder, "--out-dir", out]
    run_adapted(script, [*run, "--epochs", 1])
    before = (out / "checkpoint.pt").read_bytes()
    sorted((folder / "train" / "class_3").iterdir())[5].unlink()
    refused = run_adapted(script, [*run, "--epochs", 2], check=False)
    assert refused.returncode != 0 and "Resumed" not in refused.stdout
    assert_one_line(refused.stdout + refused.stderr, f"error: the train data in --data-dir {folder} differ from "
                                                     f"those the checkpoint in {out} was trained on (fingerprint 599:")
    assert (out / "checkpoint.pt").read_bytes() == before


SHARD_PER_RANK_LOAD_DATA = '''
def load_data(cfg, env, train: bool = True):
    """A folder per rank, as a user might shard the files by hand."""
    root = f"{cfg.data_dir}/shard{env.rank}"
    classes = dataset_utils.folder_classes(f"{root}/train")
    return dataset_utils.image_folder(f"{root}/train", classes), dataset_utils.image_folder(f"{root}/test", classes)
'''


def test_a_folder_per_rank_is_refused_in_one_line_as_each_folder_is_listed_by_rank_0_for_all(tmp_path, png_folder):
    """Rank 0 lists a folder for every rank: a rank that asks for another folder would silently get rank 0's list,
    so it is refused, on both ranks, before any training."""
    for rank in (0, 1):
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / f"shard{rank}").symlink_to(png_folder)
    script = adapted_script(tmp_path / "code", load_data=SHARD_PER_RANK_LOAD_DATA)
    refused = run_adapted(script, [*FOLDER_RUN, "--data-dir", tmp_path / "data", "--out-dir", tmp_path / "run"],
                          check=False)
    assert refused.returncode != 0 and "Training started" not in refused.stdout
    assert_one_line(refused.stdout + refused.stderr, f"error: rank 1 reads the image folder {tmp_path}/data/shard1/"
                    f"train, rank 0 {tmp_path}/data/shard0/train: a folder is listed once, by rank 0, for every rank")



# --------------------------------------------------------------------------- a folder of mixed sizes, with its own ops

MIXED_TRANSFORMS = '''
def build_transforms(cfg, data) -> tuple:
    from torchvision.transforms import v2
    train = v2.Compose([v2.RandomResizedCrop(12, scale=(0.5, 1)), v2.RandomHorizontalFlip()])
    return train, v2.Compose([v2.Resize(12), v2.CenterCrop(12)]), None
'''
# torchvision's idiom for an op of one's own, as a lambda: the workers cannot take it
LAMBDA_TRANSFORMS = MIXED_TRANSFORMS.replace("v2.RandomHorizontalFlip()", "v2.Lambda(lambda x: 255 - x)")


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory):
    """60 training and 24 test PNGs of 3 classes, 12, 14 or 16 pixels a side, as the digits come: the first training
    image 14, the first test image 16."""
    from PIL import Image
    root, noise = tmp_path_factory.mktemp("mixed"), np.random.default_rng(0)
    for split, n in (("train", 60), ("test", 24)):
        for i in range(n):
            side = (14, 16, 12)[(i // 3 + (split == "test")) % 3]
            folder = root / split / f"digit_{i % 3}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(noise.integers(0, 256, (side, side), dtype=np.uint8)).save(folder / f"{i:03d}.png")
    return root


def test_the_readme_folder_reader_honours_the_size_flags_and_the_records_name_its_data_and_sizes(tmp_path,
                                                                                                 mixed_folder):
    """The README's image-folder load_data with transforms of one's own, on 2 ranks with a loader worker each:
    --train-size 30 and --test-size 12 train on 30 and score 12 images; the Data line gives the images' size range;
    config.json, summary.json and run.json name the folder as the Data line does (not --dataset's cifar100); a
    line says where the training transform runs per image; and --evaluate scores the run's checkpoint
    on the same mixed sizes (its first test image is not the size of its first training image)."""
    script = adapted_script(tmp_path / "code", load_data=readme_load_data("image folders"),
                            build_transforms=MIXED_TRANSFORMS)
    out = tmp_path / "run"
    proc = run_adapted(script, [*TINY, "--data-dir", mixed_folder, "--train-size", 30, "--test-size", 12,
                                "--batch-size", 10, "--epochs", 1, "--workers", 1, "--device", "cpu",
                                "--log-every", 0, "--out-dir", out])
    source = f"ImageFolderSplit of {mixed_folder}/train"
    assert f"Data: {source}: 30 training and 12 test images of 3 x 12..16 x 12..16, 3 classes;" in proc.stdout
    metrics = read_jsonl(out / "metrics.jsonl")[0]
    assert metrics["train_samples"] == 30 and metrics["val_count"] == 12, metrics
    assert re.search(r"^Augmentation: the training transform runs per image in 1 DataLoader worker per rank, with "
                     r"the reads of load_data's Dataset$", proc.stdout, re.M), proc.stdout
    records = [read_json(out / "config.json"), read_json(out / "summary.json")["config"],
               read_json(out / "run.json")["config"]]
    assert all(r["dataset"] == r["data"] == source for r in records), records
    assert "does nothing here" not in proc.stdout
    scored = run_adapted(script, [*TINY, "--data-dir", mixed_folder, "--test-size", 12, "--batch-size", 10,
                                  "--workers", 1, "--device", "cpu", "--evaluate", "--out-dir", out])
    assert f"Validation Accuracy: {metrics['val_acc']:.4f}" in scored.stdout, scored.stdout + scored.stderr


def test_a_transform_that_cannot_be_pickled_is_named_in_one_line_with_its_fix_before_any_worker_starts(
        tmp_path, mixed_folder):
    """A v2.Lambda of a lambda in build_transforms, with loader workers, under torchrun on 2 ranks: every rank out
    before the first step, one error line naming the training transform and both ways out (torchrun's root cause
    too), and no pickling warning of torch's."""
    script = adapted_script(tmp_path / "code", load_data=readme_load_data("image folders"),
                            build_transforms=LAMBDA_TRANSFORMS)
    proc = run_adapted(script, [*TINY, "--data-dir", mixed_folder, "--batch-size", 10, "--epochs", 1, "--workers", 1,
                                "--device", "cpu", "--out-dir", tmp_path / "run"], check=False, torchrun=True)
    assert proc.returncode != 0 and "Epoch 1/" not in proc.stdout
    output = proc.stdout + proc.stderr
    line = assert_one_line(output, "error: the training transform (build_transforms in train_ddp.py) cannot be "
                           "sent to the DataLoader workers (Can't pickle local object 'build_transforms.<locals>."
                           "<lambda>'): make its functions top-level (no lambda, nothing defined in "
                           "build_transforms), or use --workers 0")
    assert torchrun_root_cause(output) == line
    assert "pickle error" not in output and "load_data's" not in line

# --------------------------------------------------------------------------- another model

SMALL_CNN = '''
def build_model(cfg, data) -> nn.Module:
    """A small CNN: no depth, no width."""
    return nn.Sequential(nn.Conv2d(data.channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, data.num_classes))
'''
SMALL_CNN_CONFIG = '''
def model_config(cfg, data) -> dict:
    return {"name": "SmallCNN", "in_channels": data.channels, "num_classes": data.num_classes}
'''


def test_build_model_and_model_config_alone_adapt_to_another_model(tmp_path, learnable_dir):
    script = adapted_script(tmp_path / "code", build_model=SMALL_CNN, model_config=SMALL_CNN_CONFIG)
    out = tmp_path / "run"
    run = ["--data-dir", learnable_dir, "--out-dir", out, "--workers", 0, "--timeout", 120,
           "--batch-size", 64, "--base-lr", 0.2, "--reference-batch-size", 64, "--train-size", 1500,
           "--epochs", 3, "--log-every", 0]
    run_adapted(script, [*run, "--stop-after-epoch", 1])
    resumed = run_adapted(script, run)
    assert "Resumed from" in resumed.stdout and "Training completed successfully." in resumed.stdout
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["epoch"] for m in metrics] == [1, 2, 3] and metrics[-1]["val_acc"] > 0.1  # chance: 0.01
    ckpt = load_model_state(out)
    assert ckpt["model_config"] == {"name": "SmallCNN", "in_channels": 3, "num_classes": 100}
    assert "conv1.weight" not in ckpt["model"] and ckpt["model"]["9.weight"].shape == (100, 32)
    # on another world size, 1 process (in this one)
    ev = run_in_process(["--evaluate", "--out-dir", out, "--data-dir", learnable_dir, "--workers", 0],
                        script=script, check=True)
    assert f"Evaluating {out}/checkpoint.pt (SmallCNN with 100 classes, 3 of 3 epochs trained)" in ev.stdout
    assert read_json(out / "eval.json")["val_acc"] == metrics[-1]["val_acc"]


# --------------------------------------------------------------------------- your own augmentation (docs/adapt.md)

def docs_blocks(marker: str) -> list:
    """The python blocks docs/adapt.md shows after `<!-- {marker}: the tests replace ... with exactly these
    blocks -->`, up to the next heading, exactly as written there."""
    with open(os.path.join(ROOT, "docs", "adapt.md")) as f:
        text = f.read()
    after = text.split(f"<!-- {marker}: the tests replace", 1)[1].split("\n## ", 1)[0]
    return [block.split("```", 1)[0] for block in after.split("```python\n")[1:]]


@pytest.fixture(scope="module")
def png36_folder(tmp_path_factory):
    """384 training and 64 test images of real Fashion-MNIST, zero-padded to 36 x 36, as PNG files."""
    from PIL import Image
    return write_fashion_pngs(tmp_path_factory.mktemp("pngs36"), 384, 64, lambda image, first: Image.fromarray(
        torch.nn.functional.pad(image, (4, 4, 4, 4)).numpy()))


def test_docs_augmentation_example_resumes_bit_identical_and_trains_as_1_rank_with_2_micro_steps(tmp_path,
                                                                                                 png36_folder):
    """docs/adapt.md's PNG example (RandomResizedCrop(32, scale=(0.5, 1)) and a flip, drawn in the loader
    workers): on 2 ranks, stopped mid-epoch (step 5 of 12) and resumed, the uninterrupted run's weights bit for
    bit; on 1 rank with 2 micro-steps, the same losses to float tolerance."""
    load_data, build_transforms = docs_blocks("augmentation example")
    script = adapted_script(tmp_path / "code", load_data=load_data, build_transforms=build_transforms)
    run = [*TINY, "--data-dir", png36_folder, "--batch-size", 32, "--micro-batch", 16, "--epochs", 2,
           "--base-lr", 0.1, "--workers", 1, "--device", "cpu", "--log-every", 0]
    reference = tmp_path / "reference"
    proc = run_adapted(script, [*run, "--out-dir", reference])
    assert ": 384 training and 64 test images of 1 x 36 x 36, 10 classes" in proc.stdout
    assert "two outputs for one seed" not in proc.stdout

    out, stop_file = tmp_path / "run", tmp_path / "stop"
    stop_file.touch()  # seen at the first check: --checkpoint-every 5 makes step 5 one
    stopped = run_adapted(script, [*run, "--checkpoint-every", 5, "--out-dir", out], check=False,
                          env={"DDP_STOP_FILE": str(stop_file)})
    assert "in epoch 1 after step 5" in stopped.stdout, stopped.stdout + stopped.stderr
    assert load_model_state(out)["progress"]["position"] == 160
    stop_file.unlink()
    resumed = run_adapted(script, [*run, "--out-dir", out])
    assert "and 160 samples (5 steps) of the next." in resumed.stdout
    got, want = load_model_state(out), load_model_state(reference)
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key

    # 1 rank x 2 micro-steps: the same images, crops and flips; the sums then differ only in float order, which
    # grows over the steps (on this real data, 2e-5 of the loss by epoch 1's end, where other crops are 1e-3 off).
    one = tmp_path / "one"
    run_in_process([*run, "--workers", 0, "--out-dir", one], script=script, check=True)
    first, second = read_jsonl(reference / "metrics.jsonl")[0], read_jsonl(one / "metrics.jsonl")[0]
    assert first["train_samples"] == second["train_samples"] == 384
    for key in ("train_loss", "val_loss"):
        assert second[key] == pytest.approx(first[key], rel=1e-4), key


PHOTO_TRANSFORMS = '''
def build_transforms(cfg, data) -> tuple:
    from torchvision.transforms import v2
    train = v2.Compose([v2.RandomResizedCrop(28, scale=(0.5, 1)), v2.RandomHorizontalFlip()])
    return train, v2.Compose([v2.Resize(28), v2.CenterCrop(28)]), None
'''


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    """256 training and 64 test images of real Fashion-MNIST as PNG files, each of its own size (20 to 44 pixels
    a side, as photos are), but the first of each class: 32 x 32, so that the transforms' start check passes."""
    from PIL import Image
    sizes = torch.Generator().manual_seed(0)

    def resized(image, first):
        h, w = (32, 32) if first else torch.randint(20, 45, (2,), generator=sizes).tolist()
        return Image.fromarray(image.numpy()).resize((w, h), Image.BILINEAR)
    return write_fashion_pngs(tmp_path_factory.mktemp("photos"), 256, 64, resized)


def test_photos_of_any_size_train_through_the_transforms_alone_and_one_they_mis_size_ends_every_rank_in_one_line(
        tmp_path, photo_folder):
    """build_transforms alone (no resize in load_data): RandomResizedCrop and a flip for training, Resize and
    CenterCrop for the test, on 2 ranks: every image trains and is scored. A test transform of Resize alone, which
    gives a photo of another aspect another size, ends the run at the evaluation in one line naming the file."""
    run = [*TINY, "--data-dir", photo_folder, "--batch-size", 32, "--epochs", 1, "--workers", 1, "--loader", "torch",
           "--device", "cpu", "--log-every", 0]
    script = adapted_script(tmp_path / "code", load_data=FOLDER_LOAD_DATA, build_transforms=PHOTO_TRANSFORMS)
    proc = run_adapted(script, [*run, "--out-dir", tmp_path / "run"])
    assert ": 256 training and 64 test images of 1 x 32 x 32 (the first), 10 classes" in proc.stdout
    assert "Input: the transforms make each image 1 x 28 x 28, the model's input (the first training image: " \
           "1 x 32 x 32)" in proc.stdout
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert metrics["train_samples"] == 256 and metrics["val_count"] == 64, metrics

    resize_alone = PHOTO_TRANSFORMS.replace("v2.Compose([v2.Resize(28), v2.CenterCrop(28)])", "v2.Resize(28)")
    script = adapted_script(tmp_path / "resize", load_data=FOLDER_LOAD_DATA, build_transforms=resize_alone)
    proc = run_adapted(script, [*run, "--out-dir", tmp_path / "refused"], check=False, torchrun=True)
    assert proc.returncode != 0
    line = assert_one_line(proc.stdout + proc.stderr, "the test transform (build_transforms in train_ddp.py) "
                           "returned 1 x 28 x ", "not the model's 1 x 28 x 28 uint8; make it return 1 x 28 x 28 "
                           "uint8 for every image (e.g. end with v2.Resize(28) and v2.CenterCrop((28, 28)))")
    assert re.search(r"error: test sample \d+ \(\S+/test/class_\d/\d{5}\.png\): ", line), line
