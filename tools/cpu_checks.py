"""bench.py --cpu-checks: comparisons that need no GPU, per core. Batched tensor augmentation against the
original script's PIL per-sample path, and the recipe's loop (train_one_epoch) against a bare loop, step
by step in interleaved rounds on one thread, in CPU time, with the spread of the rounds and a decision
against the 3% target (--profile: where the extra time goes)."""
import contextlib
import dataclasses
import itertools
import math
import os
import statistics
import time

import torch
import torch.nn as nn
from torch.utils.data import DistributedSampler

import dataset_utils as du
import train_ddp
from tools.benchmark import TrainSteps
from tools.original_script import original_transform
from machinery.hashing import seeded
from machinery.output import log
from machinery.timing import StepLog

WARMUP_ROUNDS = 24  # untimed rounds of the loop-overhead check: one in each order of its four loops


def augmentation_check(rounds: int = 5) -> dict:
    """Crop, flip and normalise per core: the original script's PIL per-sample path, the recipe's torchvision
    v2 crop and flip per sample, seeded (its DataLoader workers' path), and its batched tensor ops (the device
    loader's), in interleaved rounds, in CPU time (one thread); the median rate of each."""
    from torchvision.transforms import v2
    from PIL import Image
    data = du.make_synthetic(4096, train=True)
    tf = original_transform()
    hwc = data.images.permute(0, 2, 3, 1).numpy()
    normalize = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, torch.device("cpu"))
    pad = du.crop_padding(*data.images.shape[-2:])
    padded = torch.nn.functional.pad(data.images, (pad[1], pad[1], pad[0], pad[0]))
    v2_crop_flip = v2.Compose([v2.RandomCrop(32, padding=[pad[1], pad[0]]), v2.RandomHorizontalFlip()])
    pil_rates, v2_rates, tensor_rates = [], [], []
    for rnd in range(rounds):
        t = time.process_time()
        for i in range(1024):
            tf(Image.fromarray(hwc[i]))
        pil_rates.append(1024 / (time.process_time() - t))
        t = time.process_time()
        for s in range(0, 1024, 256):
            normalize(torch.stack([seeded(v2_crop_flip, (data.images[i],), i) for i in range(s, s + 256)]))
        v2_rates.append(1024 / (time.process_time() - t))
        t = time.process_time()
        for s in range(0, 4096, 512):
            idx = torch.arange(s, s + 512)
            normalize(du.crop_flip_batch(padded, idx, du.mix64(0, rnd, idx), pad))
        tensor_rates.append(4096 / (time.process_time() - t))
    aug = {"pil_img_per_s_per_core": statistics.median(pil_rates), "v2_img_per_s_per_core": statistics.median(v2_rates),
           "tensor_img_per_s_per_core": statistics.median(tensor_rates)}
    aug["speedup"] = aug["tensor_img_per_s_per_core"] / aug["pil_img_per_s_per_core"]
    return aug


def spread(values: list) -> dict:
    """Median, quartiles, range, and a distribution-free 95% confidence interval of the median (the order
    statistics the binomial distribution gives, as in a sign test)."""
    xs, n = sorted(values), len(values)
    q1, _, q3 = statistics.quantiles(xs, n=4) if n > 1 else (xs[0],) * 3
    cdf = itertools.accumulate(math.comb(n, i) / 2**n for i in range(n + 1))
    # P(fewer than j+1 values below the median) <= 2.5%
    j = max(0, next(i for i, c in enumerate(cdf) if c > 0.025) - 1)
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1],
            "ci95": (xs[j], xs[n - 1 - j]), "n": n}


def pct(s: dict) -> str:
    lo, hi = s["ci95"]
    return (f"{s['median'] * 100:+.2f}% (95% CI of the median {lo * 100:+.2f} to {hi * 100:+.2f}%; quartiles "
            f"{s['q1'] * 100:+.2f} to {s['q3'] * 100:+.2f}%; range {s['min'] * 100:+.2f} to "
            f"{s['max'] * 100:+.2f}%)")


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null for a while: the profiler's C++ side prints a line at every start and
    stop (USDT: profiler_start), whatever the log level."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def profile_loops(loops: dict, steps: int, rounds: int = 3) -> dict:
    """torch.profiler over `steps` steps of each loop, `rounds` times in turn: per op, its calls and self CPU
    time per step (ms)."""
    from torch.profiler import ProfilerActivity, profile
    tables = {name: {} for name in loops}
    for _ in range(rounds):
        for name, run in loops.items():
            with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
                run(steps)
            for e in prof.key_averages():
                calls, ms = tables[name].get(e.key, (0, 0.0))
                n = steps * rounds
                tables[name][e.key] = (calls + e.count / n, ms + e.self_cpu_time_total / 1e3 / n)
    return tables


def profile_differences(tables: dict, name: str) -> tuple:
    """What loop `name` runs beyond the bare loop: the ops the bare loop never calls, with their self CPU ms
    per step (largest first), and the ops both call but `name` more often, with the extra calls per step.
    The time of an op both call differs between the loops by the machine's noise as much as by their work."""
    bare, other = tables["bare"], tables[name]
    new = sorted(((ms, op) for op, (calls, ms) in other.items() if op not in bare), reverse=True)
    more = sorted(((calls - bare[op][0], op) for op, (calls, _) in other.items()
                   if op in bare and calls - bare[op][0] > 0.05), reverse=True)
    return [(op, ms) for ms, op in new], [(op, n) for n, op in more]


def decide(s: dict, target: float = 0.03) -> str:
    lo, hi = s["ci95"]
    return (f"at most {target:.0%}" if hi <= target else f"over {target:.0%}" if lo > target else
            f"undecided (its 95% interval holds {target:.0%}: run more --rounds)")


class ReadyLoader:
    """A training loader of one step per epoch: batches made beforehand, in turn."""

    def __init__(self, batches, batch_size: int):
        self.batches = itertools.cycle(batches)
        shard = du.ShardSampler(DistributedSampler(range(batch_size), num_replicas=1, rank=0))
        self.batch_sampler = du.StepSampler([shard], batch_size=batch_size)

    def __iter__(self):
        return iter([next(self.batches)])

    def step_split(self, position: int) -> tuple:
        return self.batch_sampler.step_split(position)

    def check(self) -> None:
        pass  # ready-made batches: nothing unreadable to agree on


def loop_overhead_check(args, cfg, env) -> dict:
    """The training loop's overhead, on one thread. Each round runs one step of each of three loops, in an
    order that cycles through all six, on the same model and optimizer (build_training's, for `cfg`):
      bare: a minimal loop over ready-made normalised batches (mean loss, zero_grad, backward, step);
      step: the recipe's loop (train_one_epoch: the LR, train_step, its loss sums, the stop check) over the
        same batches, with its normalisation left out: the same work as bare, so the difference is the
        loop's bookkeeping;
      recipe: the recipe's loop end to end: the device loader (gather, crop, flip), normalisation, train_step.
    and then the data path alone (the device loader and normalisation). TrainSteps (tools/benchmark.py):
    the recipe's loop run N steps at a time. A step of the recipe's loop is a whole epoch of it, so its work
    per epoch (the epoch's order and sums) counts in every step: an upper bound. Steps are timed in this
    process's CPU time, which other processes on the same cores inflate far less than the wall clock, and
    compared within a round (loop / bare - 1), a fraction of a second apart, so that the machine's drifts
    cancel: the median of the rounds, with a 95% interval, says whether the overhead is within 3%. The
    first WARMUP_ROUNDS are not timed."""
    data = du.make_synthetic(cfg.batch_size, train=True)  # an epoch of one step
    checked = du.CheckedData(data, data, du.measure_data(data, data), {}, env.device)
    training = train_ddp.build_training(cfg, env, checked)  # the device loader, on the CPU
    model, optimizer, loader = training.model, training.optimizer, training.train_loader
    normalize = training.normalize

    def batches(epoch):  # the recipe's normalised batches of an epoch (of one step)
        loader.batch_sampler.set_epoch(epoch)
        return [(normalize(x), y) for x, y in loader]
    ready = [batch for epoch in range(16) for batch in batches(epoch)]  # made beforehand
    bare_batches, mean_loss = itertools.cycle(ready), nn.CrossEntropyLoss()
    model.train()

    def bare_loop(n):
        for _ in range(n):
            images, labels = next(bare_batches)
            loss = mean_loss(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    identity = nn.Identity()  # a normalisation that leaves the batches normalised beforehand alone
    identity.scale = normalize.scale  # where train_step reads the device
    step = TrainSteps(model, dataclasses.replace(training, normalize=identity,
                                                  train_loader=ReadyLoader(ready, cfg.batch_size)), cfg)
    recipe = TrainSteps(model, training, cfg)
    untimed = TrainSteps(model, training, cfg,
                          step_log=StepLog(0, normalize.scale.device, timed=False))

    def data_path(n):
        for epoch in range(n):
            batches(epoch)

    loops = {"bare": bare_loop, "step": step.run, "recipe": recipe.run, "untimed": untimed.run,
             "data": data_path}
    orders = list(itertools.permutations(["bare", "step", "recipe", "untimed"]))
    times = {name: [] for name in loops}
    for rnd in range(WARMUP_ROUNDS + args.rounds):
        for name in (*orders[rnd % len(orders)], "data"):
            t = time.process_time()
            loops[name](1)
            if rnd >= WARMUP_ROUNDS:
                times[name].append(time.process_time() - t)
    ratio = {name: spread([t / b - 1 for t, b in zip(times[name], times["bare"])])
             for name in ("step", "recipe")}
    # The cost of the recipe's per-step timing (StepLog's marks): the recipe's loop against itself untimed.
    ratio["timing"] = spread([t / u - 1 for t, u in zip(times["recipe"], times["untimed"])])
    data_share = spread([t / b for t, b in zip(times["data"], times["bare"])])
    ms = {name: statistics.median(ts) for name, ts in times.items()}
    result = {"model": f"WRN-{cfg.depth}-{cfg.widen_factor}", "batch": cfg.batch_size, "rounds": args.rounds,
              "threads": torch.get_num_threads(), "clock": "process CPU time", "bare_step_s": ms["bare"],
              "step_step_s": ms["step"], "ours_step_s": ms["recipe"], "data_path_s": ms["data"],
              "untimed_step_s": ms["untimed"], "timing_cost": ratio["timing"],
              "bookkeeping": ratio["step"], "overhead": ratio["recipe"],
              "overhead_fraction": ratio["recipe"]["median"],
              "data_path_fraction": data_share["median"], "data_path_share": data_share,
              "decision": {"bookkeeping": decide(ratio["step"]), "end_to_end": decide(ratio["recipe"]),
                           "timing": decide(ratio["timing"], target=0.01)},
              "per_round_s": times}
    if args.profile:
        result["profile"] = profile_loops({"bare": bare_loop, "step": step.run, "recipe": recipe.run}, 10)
    return result


def cpu_checks(args, cfg, env) -> dict:
    """Per-core comparisons that need no GPU, on one thread: with two or more, other processes on the same
    cores make OpenMP's threads wait for each other, and a step's time swings several-fold."""
    torch.set_num_threads(1)
    return {"augmentation": augmentation_check(),
            "loop_overhead": loop_overhead_check(args, cfg, env)}


def report_cpu_checks(c: dict, seconds: float) -> None:
    a, lo = c["augmentation"], c["loop_overhead"]
    log(f"augmentation, 1 core: PIL per sample {a['pil_img_per_s_per_core']:.0f} img/s, torchvision v2 per "
        f"sample (the DataLoader workers') {a['v2_img_per_s_per_core']:.0f} img/s, "
        f"batched tensor ops {a['tensor_img_per_s_per_core']:.0f} img/s: {a['speedup']:.1f}x")
    log(f"loop overhead ({lo['model']}, batch {lo['batch']}): {lo['ours_step_s'] * 1e3:.1f} ms/step vs "
        f"bare {lo['bare_step_s'] * 1e3:.1f} ms/step: {lo['overhead_fraction'] * 100:.1f}%; the data path "
        f"alone {lo['data_path_s'] * 1e3:.2f} ms/step, {lo['data_path_fraction'] * 100:.1f}% of the bare "
        f"step (medians of {lo['rounds']} rounds, one step of each loop per round, CPU time, "
        f"{lo['threads']} thread)")
    log(f"  the recipe end to end (train_one_epoch: device loader, normalisation, train_step, loss sums, "
        f"stop check) against the bare loop over ready-made batches: {pct(lo['overhead'])}")
    log(f"  of which the step's bookkeeping (train_one_epoch on the bare loop's batches, same work): "
        f"{pct(lo['bookkeeping'])}")
    log(f"  decision (target: at most 3%): the loop's own overhead is {lo['decision']['bookkeeping']}; "
        f"end to end, with the data path, {lo['decision']['end_to_end']}")
    log(f"  the per-step time split (StepLog's marks) against the same loop untimed: "
        f"{pct(lo['timing_cost'])}; target at most 1%: {lo['decision']['timing']}")
    if "profile" in lo:
        prof = lo["profile"]
        log("  profile, self CPU ms per step (10 steps of each loop, 3 times in turn): " + "; ".join(
            f"{name} {sum(ms for _, ms in table.values()):.1f}" for name, table in prof.items()))
        for name in ("step", "recipe"):
            new, more = profile_differences(prof, name)
            log(f"  profile, {name} loop: ops the bare loop never calls, {sum(ms for _, ms in new):.2f} ms "
                f"per step: " + ", ".join(f"{op} {ms:.3f}" for op, ms in new[:12]))
            log(f"  profile, {name} loop: ops the bare loop calls too, but fewer times (extra calls per "
                f"step): " + ", ".join(f"{op} {n:+.1f}" for op, n in more[:12]))
    log(f"cpu checks took {seconds:.0f} s")
