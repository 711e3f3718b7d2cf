"""bench.py --comm-hooks: the recipe's step with each of DDP's communication hooks (--comm-hook), side by side in one
process: the bytes each rank hands the all-reduce per step, counted at torch's all_reduce as the hooks call it, and
the step's time against the same step without an all-reduce (under no_sync): the communication backward did not
hide. preflight.py --bench reads the result to predict the scaling at a job's size from a measured bandwidth."""
import contextlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from train_utils import COMM_HOOKS
from machinery.output import log
from tools.benchmark import TrainSteps

HOOK_MODULES = "torch.distributed.algorithms.ddp_comm_hooks"  # default_hooks, powerSGD_hook


@contextlib.contextmanager
def counted_all_reduce(counter: dict):
    """dist.all_reduce, as the comm hooks call it, counted in `counter` (bytes, calls); other callers untouched."""
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith(HOOK_MODULES):
            counter["bytes"] += tensor.numel() * tensor.element_size()
            counter["calls"] += 1
        return real(tensor, *args, **kwargs)
    dist.all_reduce = counting
    try:
        yield
    finally:
        dist.all_reduce = real


def comm_hooks(args, env, build) -> dict:
    """Each hook of COMM_HOOKS on a fresh model (`build(flags)`: bench.py's (model, training, cfg), DDP-wrapped with
    those flags over the given ones), --steps after --warmup (at least 3: PowerSGD compresses from step 3); `none`
    through allreduce_hook, DDP's all-reduce in Python, so that its bytes are counted too. First, the same step
    under no_sync: no all-reduce at all."""
    steps, warmup = args.steps, max(args.warmup, 3)
    result = {"what": "per rank and optimizer step: the bytes handed to all_reduce by the hook (a ring all-reduce "
              "sends 2(N-1)/N of them), and the step's seconds; comm_s: the step's time above the same step "
              "without an all-reduce (no_sync, timed on none's model first), compute_s", "world_size":
              env.world_size, "backend": dist.get_backend(), "steps": steps, "warmup": warmup,
              "powersgd_rank": args.powersgd_rank, "rows": {}}
    for hook in COMM_HOOKS:
        model, training, cfg = build({"comm_hook": hook, "powersgd_start": 2})
        if hook == "none":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        loop, counter = TrainSteps(model, training, cfg), {"bytes": 0, "calls": 0}
        loop.run(warmup)
        if hook == "none":  # the baseline, on this model: the same steps without an all-reduce
            with model.no_sync():
                result["compute_s"] = compute_s = loop.seconds_per_step(steps)
            result["gradient_bytes"] = params = sum(p.numel() * p.element_size() for p in training.model.parameters())
            log(f"comm hooks: WRN-{cfg.depth}-{cfg.widen_factor}, {params / 2**20:.1f} MiB of fp32 gradients, "
                f"batch {cfg.per_rank_batch} per rank over {env.world_size} ranks ({dist.get_backend()}); without "
                f"an all-reduce (no_sync) a step takes {compute_s * 1e3:.1f} ms")
        with counted_all_reduce(counter):
            step_s = loop.seconds_per_step(steps)
        row = {"bytes_per_step": counter["bytes"] / steps, "all_reduces_per_step": counter["calls"] / steps,
               "step_s": step_s, "comm_s": max(0.0, step_s - compute_s)}
        row["bytes_ratio"] = row["bytes_per_step"] / result["rows"]["none"]["bytes_per_step"] if hook != "none" else 1
        result["rows"][hook] = row
        log(f"comm hook {hook}: {row['bytes_per_step'] / 2**20:.2f} MiB per step ({row['bytes_ratio']:.3f}x none's) "
            f"in {row['all_reduces_per_step']:.0f} all-reduces; step {step_s * 1e3:.1f} ms, "
            f"{row['comm_s'] * 1e3:.1f} ms above no all-reduce")
        del model, training, loop
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return result
