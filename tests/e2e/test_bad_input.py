"""Each bad input: one clear line naming the fix, a non-zero exit, no traceback, nothing overwritten:
bad flags, a batch the world size does not divide, missing or corrupt data, an unwritable out-dir, a
temporary folder too long for the loader workers' socket, and checkpoints that cannot be continued (corrupt,
of another model, from another device type, from an older train_ddp.py). The refusals of one plain process
run in this process (support.run_in_process: the entry point without a fresh interpreter); those of several
ranks through torchrun."""
import hashlib
import multiprocessing.util
import os

import pytest
import torch

from support import ACCUM_RUN, TINY, launch, run_in_process, torchrun_root_cause, write_cifar100

SMALL = ["--dataset", "synthetic", "--train-size", 64, "--test-size", 20, "--batch-size", 32,
         "--epochs", 1, *TINY]
OFFLINE = {"CIFAR100_URL": "http://127.0.0.1:9/cifar-100-python.tar.gz"}  # refused at once, as offline


def snapshot(d):
    if not os.path.isdir(d):
        return None
    return {f: hashlib.md5(open(os.path.join(d, f), "rb").read()).hexdigest() for f in sorted(os.listdir(d))}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A good run whose out-dir the bad runs point at: none of them may change it."""
    out = tmp_path_factory.mktemp("good") / "run"
    run_in_process([*SMALL, "--out-dir", out], check=True)
    return out


def assert_refused(proc, expected, torchrun=False):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr  # printed by rank 0 alone
    assert expected in lines[0], lines[0]
    if torchrun:  # torchrun adds its own failure report; none of it comes from our code
        assert "train_ddp.py\", line" not in proc.stdout + proc.stderr
        # and its root cause is the rank's line, not <N/A> (the ranks leave it in torchrun's error file)
        assert torchrun_root_cause(proc.stderr) == lines[0], proc.stderr
    else:
        assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("args,expected", [
    (["--depth", 12], "--depth must be 6n+4 with n >= 1 (10, 16, 22, 28, 40, ...), got 12"),
    (["--epochs", 0], "--epochs must be at least 1, got 0"),
    (["--epochs", -3], "--epochs must be at least 1, got -3"),
    (["--target-accuracy", 85], "--target-accuracy is a fraction in [0, 1], got 85.0 (85% is 0.85;"),
    (["--target-accuracy", -0.1], "--target-accuracy is a fraction in [0, 1]"),
    (["--target-accuracy", 1.1], "to train every epoch, turn early stopping off with --patience 0"),
    (["--patience", -1], "--patience is a number of epochs in a row at the target, got -1 (0: no early stopping"),
])
def test_bad_arguments_are_refused_in_one_line(finished_run, args, expected):
    before = snapshot(finished_run)
    assert_refused(run_in_process([*SMALL, "--out-dir", finished_run, *args]), expected)
    assert snapshot(finished_run) == before


@pytest.mark.quick
def test_batch_that_the_world_size_does_not_divide_is_refused_naming_one_that_does(finished_run):
    before = snapshot(finished_run)
    proc = launch([*SMALL, "--out-dir", finished_run, "--batch-size", 63], nproc=2, check=False)
    assert_refused(proc,
                   "--batch-size 63 must be a positive multiple of the world size 2; try --batch-size 64",
                   torchrun=True)
    assert snapshot(finished_run) == before


def test_missing_data_offline_is_refused_naming_the_archive_to_place(tmp_path):
    data, out = tmp_path / "nodata", tmp_path / "run"
    proc = launch(["--data-dir", data, "--out-dir", out, *TINY], nproc=2, env=OFFLINE, check=False)
    assert_refused(proc, f"CIFAR-100 is not in {data} and downloading it failed", torchrun=True)
    assert "place cifar-100-python.tar.gz" in proc.stderr
    assert os.listdir(data) == [] and os.listdir(out) == []


def test_corrupt_archive_is_refused_and_nothing_extracted(tmp_path):
    write_cifar100(str(tmp_path), 20, 10)  # its md5 is not the official one
    out = tmp_path / "run"
    proc = run_in_process(["--data-dir", tmp_path, "--out-dir", out, *TINY], env=OFFLINE)
    assert_refused(proc, "cifar-100-python.tar.gz fails its md5 check")
    assert os.listdir(out) == [] and not (tmp_path / "cifar-100-python").exists()


def test_a_temporary_folder_too_long_for_the_loader_workers_socket_is_refused_in_one_line_unless_python_moves_it(
        tmp_path):
    """A long TMPDIR (a job's scratch folder) leaves no room for the loader workers' forkserver socket: one
    line naming it and the ways out, before any training, instead of a traceback from the first batch (AF_UNIX
    path too long). A Python whose multiprocessing moves such a folder to /tmp itself (newer CPythons do) trains
    instead. A launched process: Python reads TMPDIR when it starts."""
    long_tmp = tmp_path / ("t" * (100 - len(str(tmp_path)) - 1))  # 100 bytes; the socket would be 132
    long_tmp.mkdir()
    out = tmp_path / "run"
    proc = launch([*SMALL, "--workers", 1, "--out-dir", out], torchrun=False, env={"TMPDIR": str(long_tmp)},
                  check=False)
    if hasattr(multiprocessing.util, "_get_base_temp_dir"):  # a Python that moves a socket's folder
        assert proc.returncode == 0 and "Training completed successfully." in proc.stdout, proc.stderr
        return
    assert_refused(proc, f"TMPDIR {long_tmp} (100 bytes) is too long for the DataLoader workers' socket in it "
                         f"(132 bytes, over 107)")
    assert "set TMPDIR to at most 75 bytes (export TMPDIR=/tmp) or use --workers 0" in proc.stderr
    assert proc.returncode == 2 and os.listdir(out) == []


def test_checkpoint_of_another_model_is_refused_under_torchrun(finished_run):
    before = snapshot(finished_run)
    proc = launch([*SMALL, "--out-dir", finished_run, "--depth", 16], nproc=2, check=False)
    assert_refused(proc, "--depth 16 differs from the 10 of the checkpoint in", torchrun=True)
    assert (f"of the checkpoint in {finished_run}, which trained another model: use another --out-dir for a "
            "new run, or --depth 10 to continue it" in proc.stderr)
    assert snapshot(finished_run) == before


def test_unwritable_out_dir_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_in_process([*SMALL, "--out-dir", blocker / "run"])
    assert_refused(proc, f"--out-dir {blocker / 'run'} is not writable")
    assert blocker.read_text() == "not a directory"


@pytest.mark.quick
def test_corrupt_checkpoint_is_refused_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"garbage")
    proc = run_in_process([*SMALL, "--out-dir", out])
    assert_refused(proc, f"no usable checkpoint in {out}: {out / 'checkpoint.pt'} cannot be loaded")
    assert (out / "checkpoint.pt").read_bytes() == b"garbage"


def test_checkpoint_from_another_device_type_is_refused(tmp_path, finished_run):
    out = tmp_path / "run"
    out.mkdir()
    ckpt = torch.load(finished_run / "checkpoint.pt", weights_only=True)
    ckpt["config"]["device_type"] = "cuda"  # as if trained on GPUs; this run is on CPU
    torch.save(ckpt, out / "checkpoint.pt")
    before = snapshot(out)
    proc = run_in_process([*SMALL, "--epochs", 2, "--out-dir", out])
    assert_refused(proc, f"{out / 'checkpoint.pt'} was trained on cuda, and this run is on cpu: "
                         f"resume with --device cuda, or train afresh in another --out-dir")
    assert snapshot(out) == before
    evaluated = run_in_process([*SMALL, "--out-dir", out, "--evaluate"], check=True)  # evaluating it is fine
    assert "Validation Accuracy" in evaluated.stdout


def test_checkpoint_of_an_older_version_is_refused_in_one_line(tmp_path, finished_run):
    out = tmp_path / "run"
    out.mkdir()
    ckpt = torch.load(finished_run / "checkpoint.pt", weights_only=True)
    del ckpt["config"]["data_spec"]  # as written before the data described themselves
    torch.save(ckpt, out / "checkpoint.pt")
    before = snapshot(out)
    for extra in ([], ["--evaluate"]):
        proc = run_in_process([*SMALL, "--epochs", 2, "--out-dir", out, *extra])
        assert_refused(proc, f"{out / 'checkpoint.pt'} was written by an older train_ddp.py")
    assert snapshot(out) == before


@pytest.mark.parametrize("flags,says", [
    (["--micro-batch", 0], "--micro-batch is the most samples per forward on one rank, at least 1, got 0"),
    (["--micro-batch", -8], "--micro-batch is the most samples per forward on one rank, at least 1, got -8"),
    (["--sync-bn"], "--sync-bn needs CUDA GPUs"),
])
def test_bad_micro_batch_or_sync_bn_on_cpu_is_refused(tmp_path, flags, says):
    proc = run_in_process([*ACCUM_RUN, "--out-dir", tmp_path / "run", *flags])
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr
