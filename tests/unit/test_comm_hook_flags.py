"""--comm-hook's and its companions' checks, each one line: a hook the backend cannot all-reduce is refused naming
those it can; --powersgd-start under 2, --powersgd-rank under 1 and a bucket of no size are refused; what a hook
changes is said at the start (machinery.comm_hooks.comm_hook_notes): nothing in one process, exactness given up in
several, PowerSGD never starting in a short run."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from train_utils import check_args, get_args_parser
from machinery.comm_hooks import comm_hook_notes, torch_comm_hook
from machinery.errors import UserError
from machinery.launch import DistEnv


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def hook_cfg(hook, **flags):
    return SimpleNamespace(comm_hook=hook, powersgd_rank=1, powersgd_start=1000, seed=0, **flags)


def test_a_half_precision_hook_the_backend_cannot_all_reduce_is_one_line_naming_those_it_can(one_rank_group,
                                                                                                monkeypatch):
    env = DistEnv()  # one CPU rank
    assert torch_comm_hook(hook_cfg("bf16"), env)[1].__name__ == "bf16_compress_hook"  # gloo runs it here
    real = dist.all_reduce

    def no_bf16(tensor, *args, **kwargs):  # a backend without bfloat16 sums
        if tensor.dtype == torch.bfloat16:
            raise RuntimeError("Unsupported dtype BFloat16")
        return real(tensor, *args, **kwargs)
    monkeypatch.setattr(dist, "all_reduce", no_bf16)
    with pytest.raises(UserError) as refused:
        torch_comm_hook(hook_cfg("bf16"), env)
    assert str(refused.value) == ("--comm-hook bf16: the gloo backend here cannot all-reduce torch.bfloat16 "
                                  "tensors; use --comm-hook fp16 or none")
    assert torch_comm_hook(hook_cfg("fp16"), env)[1].__name__ == "fp16_compress_hook"
    assert torch_comm_hook(hook_cfg("none"), env) == (None, None)


@pytest.mark.parametrize("flags, says", [
    (["--powersgd-start", "1"], "--powersgd-start must be at least 2, got 1 (DDP rebuilds its buckets"),
    (["--powersgd-rank", "0"], "--powersgd-rank must be at least 1, got 0"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be positive, got 0.0"),
])
def test_powersgd_and_bucket_flags_out_of_range_are_refused_in_one_line(flags, says):
    with pytest.raises(UserError, match=says.replace("(", r"\(")):
        check_args(get_args_parser().parse_args(flags), 2, torch.device("cpu"))


def notes(hook, world_size=2, steps=5000, ckpt=None, **flags):
    return comm_hook_notes(hook_cfg(hook, world_size=world_size, **flags), ckpt, steps=steps)


def test_what_a_hook_changes_is_said_at_the_start():
    assert notes("none") == [] and notes("none", world_size=1) == []
    assert notes("fp16", world_size=1) == [
        "--comm-hook fp16 does nothing in a run of one process: there is no all-reduce to compress"]
    assert notes("bf16") == [
        "--comm-hook bf16 rounds the all-reduced gradients to 16 bits: the run no longer trains bit for bit as one "
        "with another split of the same global batch (ranks x micro-steps), nor does a resume onto another world "
        "size"]
    assert notes("powersgd", steps=800)[1] == (
        "--powersgd-start 1000 is at least the run's 800 optimizer steps: PowerSGD never compresses; lower "
        "--powersgd-start")
    assert len(notes("powersgd")) == 1 and notes("powersgd", ckpt={})[1].startswith(
        "PowerSGD starts afresh on this resume: 1000 steps of plain all-reduce")
