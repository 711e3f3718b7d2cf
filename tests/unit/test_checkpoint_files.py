"""Checkpoint files and format (machinery.checkpoints; train_utils.Checkpoint, the registry of what a
checkpoint holds): a kill -9 at any moment of a save leaves the newest complete checkpoint loadable and
the next save tidies up; a checkpoint holding pickled code is refused without running it; a checkpoint of
an older train_ddp.py (one that lacks any key this version requires) is refused in one line, while one
that lacks only optional state an option added later resumes, saying what stands in for it; and the
room check sizes the optimizer's real state."""
import copy
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

import dataset_utils as du
import train_ddp
from support import ROOT, SCRIPTS
from machinery.checkpoints import load_latest_checkpoint, save_checkpoint, state_bytes
from machinery.resume import OPTIONAL_PROGRESS_KEYS, REQUIRED_PROGRESS_KEYS, check_format, fingerprint
from machinery.errors import UserError
from machinery.launch import DistEnv
from train_utils import Checkpoint, Found, Progress, get_args_parser, make_config


def load_checkpoint(path, device=torch.device("cpu")):
    """As train_utils.find_checkpoint reads a checkpoint: torch.load, weights_only."""
    return torch.load(path, map_location=device, weights_only=True)


@pytest.mark.parametrize("moment, survivor",
                         [("mid-write", "checkpoint.pt"), ("before-rename", "checkpoint.1.pt")])
def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path, moment, survivor):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, SCRIPTS, "kill_during_save.py"), str(tmp_path),
                           moment], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the killed write left its partial file"
    ckpt, path = load_latest_checkpoint(str(tmp_path), load_checkpoint, keep=2)
    assert path == str(tmp_path / survivor) and ckpt["progress"]["epoch"] == 2  # the last complete one
    assert torch.equal(ckpt["model"]["w"], torch.full((1 << 20,), 2.0))
    save_checkpoint(str(tmp_path), lambda f: torch.save({"model": {}, "progress": {"epoch": 3}}, f),
                    keep=2)  # the next save tidies up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.1.pt", "checkpoint.pt"]


def test_checkpoint_holding_pickled_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))
    torch.save({"model": {}, "progress": Payload()}, tmp_path / "checkpoint.pt")
    with pytest.raises(UserError, match="no usable checkpoint.*cannot be loaded"):
        load_latest_checkpoint(str(tmp_path), load_checkpoint, keep=2)
    assert not (tmp_path / "owned").exists()


def build_run(out_dir, flags=()):
    """A tiny run's config, data and training, as train() makes them, on one CPU process."""
    args = get_args_parser().parse_args(["--depth", "10", "--widen-factor", "1",
                                                   "--batch-size", "32", "--dataset", "synthetic",
                                                   "--out-dir", str(out_dir), *flags])
    env = DistEnv()
    cfg = make_config(args, env)
    split = du.load_split("synthetic", "", True, size=64)
    data = du.CheckedData(split, split, du.measure_data(split, split),
                                   {"train": fingerprint(split),
                                    "test": fingerprint(split)}, None)
    return cfg, env, data, train_ddp.build_training(cfg, env, data)


def registry(cfg, env, data, training):
    return Checkpoint(cfg, env, data, model_config=train_ddp.model_config(cfg, data.spec),
                      model=training.model, optimizer=training.optimizer, scaler=training.scaler)


@pytest.fixture(scope="module")
def current_checkpoint(tmp_path_factory):
    """A checkpoint as this version writes it (Checkpoint.save, as train() calls it), loaded back."""
    out = tmp_path_factory.mktemp("ckpt")
    registry(*build_run(out)).save(Progress())
    return load_checkpoint(str(out / "checkpoint.pt"), torch.device("cpu"))


def test_a_checkpoint_of_this_version_passes_the_format_check(current_checkpoint):
    check_format(current_checkpoint, "checkpoint.pt", required=("model", "optimizer", "scaler"))


def test_the_format_requires_every_field_of_progress_but_those_added_with_an_exact_default():
    assert REQUIRED_PROGRESS_KEYS + OPTIONAL_PROGRESS_KEYS == tuple(asdict(Progress()))
    assert Progress().skipped == []  # an older checkpoint skipped nothing


def test_optional_state_absent_from_an_older_checkpoint_is_started_as_registered_and_said(tmp_path, capsys):
    """An option's state (an EMA, say) added after a checkpoint was written: that checkpoint still resumes,
    the registered stand-in is applied, one note says so; present, it is restored like the rest."""
    cfg, env, data, training = build_run(tmp_path)
    registry(cfg, env, data, training).save(Progress())  # written before the option existed
    found = Found(load_checkpoint(str(tmp_path / "checkpoint.pt"), torch.device("cpu")),
                  str(tmp_path / "checkpoint.pt"))
    extra, started = torch.nn.Linear(2, 2), []
    checkpoint = registry(cfg, env, data, training)
    checkpoint.add("extra", extra, when_absent="it starts afresh", start_absent=lambda: started.append(True))
    checkpoint.restore(found)
    assert started == [True]
    assert (f"note: {found.path} holds no extra (written before it was added): it starts afresh"
            in capsys.readouterr().out)
    with torch.no_grad():
        extra.weight.fill_(3.0)
    checkpoint.save(Progress(epoch=1))  # now it holds it
    other = torch.nn.Linear(2, 2)
    again = registry(cfg, env, data, training)
    again.add("extra", other, when_absent="it starts afresh", start_absent=lambda: started.append(False))
    again.restore(Found(load_checkpoint(found.path, torch.device("cpu")), found.path))
    assert started == [True] and torch.equal(other.weight, torch.full((2, 2), 3.0))


def test_required_state_absent_is_refused_as_an_older_checkpoint(tmp_path):
    cfg, env, data, training = build_run(tmp_path)
    registry(cfg, env, data, training).save(Progress())
    ckpt = load_checkpoint(str(tmp_path / "checkpoint.pt"), torch.device("cpu"))
    del ckpt["optimizer"]
    with pytest.raises(UserError, match="was written by an older train_ddp.py .it lacks optimizer"):
        registry(cfg, env, data, training).restore(Found(ckpt, "checkpoint.pt"))


@pytest.mark.parametrize("optimizer, moments", [("sgd-momentum", 1), ("adam", 2), ("sgd-plain", 0)])
def test_the_room_check_sizes_the_optimizer_s_real_state_before_its_first_step(optimizer, moments):
    """SGD with momentum keeps one buffer per parameter, Adam two (and a step count), plain SGD none:
    the size the room check uses, measured before any step, is what a checkpoint after one step holds."""
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.BatchNorm1d(50))
    make = {"sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=0.1),
            "sgd-plain": lambda p: torch.optim.SGD(p, lr=0.1)}[optimizer]
    opt = make(model.parameters())
    before = state_bytes(opt)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert moments * params <= before <= moments * params + 64 * len(list(model.parameters()))
    model(torch.randn(4, 100)).sum().backward()
    opt.step()
    assert before == state_bytes(opt)  # measured after the first step: the same


@pytest.mark.parametrize("val_size, copies", [(0, 1), (16, 2)])
def test_the_room_check_counts_best_pt_beside_the_checkpoint_with_a_validation_split(tmp_path, monkeypatch,
                                                                                     val_size, copies):
    """With --val-size an epoch's end may write best.pt and checkpoint.pt: room for both is needed to
    start."""
    cfg, env, data, training = build_run(tmp_path, ["--val-size", str(val_size)])
    checkpoint = registry(cfg, env, data, training)
    one = sum(state_bytes(obj) for obj in checkpoint.objects().values())
    free = {"bytes": copies * one}
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=10 * one, used=0, free=free["bytes"]))
    checkpoint.check_room()  # exactly enough
    free["bytes"] -= 1
    with pytest.raises(UserError, match="no space left on device"):
        checkpoint.check_room()


@pytest.mark.parametrize("missing", ["config.data_spec", "config.accumulation_steps",
                                     "config.micro_batch_size", "config.device_type", "progress.position",
                                     "progress.sums", "progress.history", "model_config", "data", "scaler",
                                     "rng_cpu", "config", "config.epochs"])
def test_a_checkpoint_that_lacks_a_key_this_version_reads_is_refused_as_older_in_one_line(current_checkpoint,
                                                                                          missing):
    ckpt = copy.deepcopy(current_checkpoint)
    *parents, key = missing.split(".")
    holder = ckpt
    for parent in parents:
        holder = holder[parent]
    del holder[key]
    with pytest.raises(UserError) as e:
        check_format(ckpt, "/runs/x/checkpoint.pt", required=("model", "optimizer", "scaler"))
    message = str(e.value)
    assert (message.startswith("/runs/x/checkpoint.pt was written by an older train_ddp.py")
            and "\n" not in message)
    # it names what is missing (a whole config: its keys)
    assert missing in message or missing == "config", message
    assert "another --out-dir" in message


def test_a_resume_whose_augmentation_draws_changed_says_so_in_one_line(capsys):
    """A checkpoint of the last release (no "draws": its own hash-drawn ops) or of the other loader resumes, with
    one note that the draws changed; the same draws, no note."""
    from machinery.resume import note_resume_changes
    cfg = SimpleNamespace(lr=0.1, batch_size=64, world_size=2, accumulation_steps=1, micro_batch_size=32)
    saved = {"lr": 0.1, "batch_size": 64, "world_size": 2, "accumulation_steps": 1, "micro_batch_size": 32}
    now = "torchvision's ops, seeded per image and micro-batch"
    for before in ({}, {"draws": "the device loader's crop and flip, from a hash"}):
        note_resume_changes({**saved, **before}, cfg, Progress(), draws=now)
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 1 and lines[0].startswith("note: the augmentation drew from ") and now in lines[0]
    note_resume_changes({**saved, "draws": now}, cfg, Progress(), draws=now)
    assert capsys.readouterr().out == ""
