"""Checkpoint files (train_utils.save_checkpoint, load_latest_checkpoint, check_checkpoint_format): a
kill -9 at any moment of a save leaves the newest complete checkpoint loadable and the next save tidies
up; a checkpoint holding pickled code is refused without running it; and a checkpoint of an older
train_ddp.py (one that lacks any key this version reads) is refused in one line."""
import copy
import os
import signal
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import dataset_utils as du
import train_ddp
from support import ROOT, SCRIPTS
from train_utils import (DistEnv, Progress, UserError, check_checkpoint_format, load_checkpoint, load_latest_checkpoint,
                         run_config, save_checkpoint, training_state)


@pytest.mark.parametrize("moment, survivor", [("mid-write", "checkpoint.pt"), ("before-rename", "checkpoint.1.pt")])
def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path, moment, survivor):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, SCRIPTS, "kill_during_save.py"), str(tmp_path), moment],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the killed write left its partial file"
    ckpt, path = load_latest_checkpoint(str(tmp_path), torch.device("cpu"), keep=2)
    assert path == str(tmp_path / survivor) and ckpt["progress"]["epoch"] == 2  # the last complete one
    assert torch.equal(ckpt["model"]["w"], torch.full((1 << 20,), 2.0))
    save_checkpoint(str(tmp_path), {"model": {}, "progress": {"epoch": 3}}, keep=2)  # the next save tidies up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.1.pt", "checkpoint.pt"]


def test_checkpoint_holding_pickled_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))
    torch.save({"model": {}, "progress": Payload()}, tmp_path / "checkpoint.pt")
    with pytest.raises(UserError, match="no usable checkpoint.*cannot be loaded"):
        load_latest_checkpoint(str(tmp_path), torch.device("cpu"), keep=2)
    assert not (tmp_path / "owned").exists()


@pytest.fixture(scope="module")
def current_checkpoint(tmp_path_factory):
    """A checkpoint as this version writes it (training_state, as train() calls it), saved and loaded back."""
    args = train_ddp.get_args_parser().parse_args(["--depth", "10", "--widen-factor", "1", "--batch-size", "32",
                                                   "--dataset", "synthetic"])
    data = du.load_split("synthetic", "", True, size=64)
    spec = du.describe_data(data, data)
    config = run_config(args, DistEnv(), ranks=[{"host": "here"}], per_rank_batch=32, accum_steps=1, lr=0.01,
                        amp_dtype=None)
    config["data_spec"] = asdict(spec)
    model = train_ddp.build_model(args, spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = training_state(model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu", enabled=False),
                           progress=Progress(), config=config, model_config=train_ddp.model_config(args, spec),
                           fingerprints={"train": du.fingerprint(data), "test": du.fingerprint(data)},
                           device=torch.device("cpu"))
    out = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(str(out), state, keep=2)
    return load_checkpoint(str(out / "checkpoint.pt"), torch.device("cpu"))


def test_a_checkpoint_of_this_version_passes_the_format_check(current_checkpoint):
    check_checkpoint_format(current_checkpoint, "checkpoint.pt")


@pytest.mark.parametrize("missing", ["config.data_spec", "config.accumulation_steps", "config.micro_batch_size",
                                     "config.device_type", "progress.position", "progress.sums", "progress.history",
                                     "model_config", "data", "scaler", "rng_cpu", "config"])
def test_a_checkpoint_that_lacks_a_key_this_version_reads_is_refused_as_older_in_one_line(current_checkpoint, missing):
    ckpt = copy.deepcopy(current_checkpoint)
    *parents, key = missing.split(".")
    holder = ckpt
    for parent in parents:
        holder = holder[parent]
    del holder[key]
    with pytest.raises(UserError) as e:
        check_checkpoint_format(ckpt, "/runs/x/checkpoint.pt")
    message = str(e.value)
    assert message.startswith("/runs/x/checkpoint.pt was written by an older train_ddp.py") and "\n" not in message
    assert missing in message or missing == "config", message  # it names what is missing (a whole config: its keys)
    assert "another --out-dir" in message
