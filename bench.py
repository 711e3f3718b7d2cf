"""Benchmark the recipe's training loop, launched like training (plain python or torchrun).

    torchrun --standalone --nproc_per_node=4 bench.py --compile --compare-original   # GPUs
    python bench.py --cpu-checks                                                      # CPU, about 2 minutes
    torchrun --standalone --nproc_per_node=4 bench.py --loader-check <the run's flags>  # does the loader keep up?

The headline (img/s global and per GPU, step time) times the recipe itself: train_ddp.train_one_epoch (the
LR, train_ddp.train_step, the loss sums, the ranks' stop check every 10 steps) over an epoch of --steps
steps after --warmup untimed ones, on what train_ddp.build_training makes from the recipe's own flags
(train_ddp.py's, taken here as given, on synthetic data): the model, SGD, grad scaler, summing loss,
loader and normalisation; in DDP with gradient_as_bucket_view and, with --compile, torch.compile, as
train() wraps them. A change to the recipe shows here. A second, separately instrumented run of the same
loop splits the step into data, forward+backward, optimizer and exposed communication. Also: MFU against
the device's dense bf16/fp16 tensor-core peak, peak memory, and the augmentation of a whole epoch; all
of it, with the exact configuration, as JSON. --compare-original times, on the same device in the same
run, the original script's pipeline (the train_ddp.py of the "PyTorch on Olivia" guide: PIL transforms
in DataLoader workers, fp16 autocast, no channels_last, no compile) and gives the ratio. GPU time is
taken with CUDA events, CPU time with the wall clock (machinery/timing.py's Clock), after warm-up steps.

--cpu-checks (tools/cpu_checks.py) needs no GPU and takes about two minutes on 2 cores: batched
tensor augmentation against the PIL per-sample path, per core, and the recipe's loop against a bare loop,
in CPU time, with a decision against the 3% target (--profile: where the extra time goes). It runs
WRN-10-1 at batch 64 unless --depth, --widen-factor or --batch-size say otherwise.

--loader-check reads batches from --data-dir through the run's own load_data, build_transforms, --loader and
--workers (train_ddp.py's defaults, not bench.py's: give the run's flags), copied to the device and nothing else,
on every rank at once; then it times the recipe's step on images of the model's input size already on the device.
It says how many images per second the loader delivers against what the step consumes and, when it falls short,
the fixes that fit the run (more --workers, the data staged on each node's local disk, the device loader).

--comm-hooks (tools/comm_bench.py) times the step with each of DDP's communication hooks (--comm-hook) side by side:
the bytes each rank all-reduces per step, and the time above the same step without an all-reduce; preflight.py
--bench predicts from it the scaling at a job's size (docs/comm-hooks.md).

SIGTERM (timeout, scancel, torchrun) and Ctrl-C stop it at once: one line on stderr, exit status 128 + the
signal's number (143, 130).
"""
import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

import dataset_utils as du
import train_ddp
import train_utils as utils
from machinery.comm_hooks import torch_comm_hook
from machinery.errors import UserError, all_gather
from machinery.files import write_json
from machinery.launch import cpus_per_rank
from machinery.output import log
from machinery.timing import Clock, StepLog
from tools.tool_exit import run_tool
from tools.benchmark import TrainSteps, cpu_name, flops_per_image, peak_flops, time_phases
from tools.comm_bench import comm_hooks
from tools.cpu_checks import cpu_checks, report_cpu_checks
from tools.loader_check import file_system, judge, name_fixes, read_rate, say_verdict
from tools.original_script import original_batches, original_steps

# The model and batch: the recipe's, and the small ones --cpu-checks takes unless told otherwise.
SHAPE_DEFAULTS = {"depth": 16, "widen_factor": 8, "batch_size": 512}
CPU_CHECK_DEFAULTS = {"depth": 10, "widen_factor": 1, "batch_size": 64}
# Where bench.py's defaults differ from train_ddp.py's (None: resolve_shape fills it in).
BENCH_DEFAULTS = {**dict.fromkeys(SHAPE_DEFAULTS), "workers": 8, "loader": "gpu", "dataset": "synthetic"}
# bench.py's switches: what it runs besides the headline, and how.
SWITCHES = {
    "--static-graph": "DDP static_graph=True (the same graph every step)",
    "--compare-original": "also time the original script's pipeline (PIL transforms in DataLoader workers, fp16, "
                          "no channels_last, no compile), same device, same run",
    "--cpu-checks": "augmentation per core, and the loop's overhead against a bare loop (WRN-10-1, batch 64 unless "
                    "given; on images of its own: --train-size does nothing there)",
    "--profile": "--cpu-checks: also profile a few steps of each loop (torch.profiler) and print where their time "
                 "goes (not train_ddp.py's --profile)",
    "--augment-share": "the modern recipe's augmentation (TrivialAugment, random erasing, mixup/cutmix): the step "
                       "with and without it, and its loader alone, on both loaders",
    "--loader-check": "read batches from --data-dir with the run's loader and workers, and say whether they keep up "
                      "with the step (give the run's flags: train_ddp.py's defaults)",
    "--candidates": "time ways to a faster step side by side, each against the default: compile modes, twice the "
                    "batch, the optimizer step compiled; and the evaluation's cost",
    "--comm-hooks": "the step with each --comm-hook side by side: the bytes each rank all-reduces per step, and the "
                    "time above a step without an all-reduce (for preflight.py --bench)",
}


def get_args_parser(loader_check: bool = False):
    """train_ddp.py's flags (train_utils.get_args_parser), with BENCH_DEFAULTS unless for --loader-check (the run's
    flags, with train_ddp.py's defaults), and bench.py's own after them."""
    p = utils.get_args_parser()
    p.description = __doc__.split("\n")[0]
    p.epilog = ("train_ddp.py's flags make the step timed as they make training's, on synthetic data in "
                "memory (--dataset synthetic only; --train-size: how many, 0 for CIFAR-100's 50,000): "
                "those of files and evaluation (--data-dir, --out-dir, --evaluate, --tensorboard, ...) do "
                "nothing here but with --loader-check, where every flag is the run's. --profile is bench.py's own.")
    if not loader_check:  # the help's defaults are then bench.py's; the epilog gives train_ddp.py's
        unlike = ", ".join(f"--{dest.replace('_', '-')} {value} (train_ddp.py's: {p.get_default(dest)})"
                           for dest, value in BENCH_DEFAULTS.items() if value is not None)
        p.epilog += (f" Defaults unlike train_ddp.py's (but with --loader-check): {unlike}; --depth, --widen-factor "
                     f"and --batch-size unset (None) take {', '.join(map(str, SHAPE_DEFAULTS.values()))}, the "
                     f"recipe's, or {', '.join(map(str, CPU_CHECK_DEFAULTS.values()))} with --cpu-checks.")
        p.set_defaults(**BENCH_DEFAULTS)
    # "resolve": bench.py's --profile replaces train_ddp.py's (a trace of training steps into its out-dir).
    add = p.add_argument_group("bench.py's own", conflict_handler="resolve").add_argument
    add("--steps", type=int, default=50, help="timed steps")
    add("--warmup", type=int, default=10, help="untimed steps first (compile, cuDNN autotuning)")
    add("--rounds", type=int, default=200,
        help="--cpu-checks: rounds of the loop-overhead check, one step of each loop per round")
    add("--compile-backend", default="inductor", help="torch.compile's backend (eager, aot_eager: a dry run "
        "that checks the plumbing, not the compiler's speed)")
    add("--json", default=None, help="write the results here (None: runs/bench/bench-<device>-<ws>x.json)")
    for flag, words in SWITCHES.items():
        add(flag, action="store_true", help=words)
    return p


def resolve_shape(args) -> None:
    """Fill in --depth, --widen-factor and --batch-size left unset: the recipe's, or --cpu-checks' small
    ones."""
    for name, value in (CPU_CHECK_DEFAULTS if args.cpu_checks else SHAPE_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


# ----------------------------------------------------------------------------- the recipe's loop, timed

def recipe_config(args, env, **flags) -> utils.RunConfig:
    """The recipe's config (config.make_config, a collective) from train_ddp.py's flags in `args` and `flags`
    over them, on synthetic data, without train_ddp.py's --profile; checked as train_ddp.py checks them."""
    recipe = utils.get_args_parser().parse_args([])
    vars(recipe).update({**{name: getattr(args, name) for name in vars(recipe)}, "dataset": "synthetic",
                         "profile": False, **flags})
    utils.check_args(recipe, env.world_size, env.device)
    return utils.make_config(recipe, env)


def wrap(model, args, env, compile_model: bool, step_log=None, mode=None):
    """train_ddp.wrap_ddp's DDP wrapping (--bucket-cap-mb, --comm-hook), with bench.py's --static-graph, and train()'s
    compile; `step_log`: the StepLog that times DDP's all-reduce, as train() has it (None: untimed, DDP's own
    C++ all-reduce without --comm-hook); `mode`: torch.compile's (None: --compile-mode)."""
    if env.distributed:
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                    gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb,
                    static_graph=args.static_graph, **utils.NO_FORWARD_BUFFER_SYNC)
        state, hook = torch_comm_hook(args, env)
        hook = step_log.timed_hook(hook) if step_log is not None else hook
        if hook is not None:
            model.register_comm_hook(state, hook)
    return compile_fn(model, args, mode) if compile_model else model


def compile_fn(fn, args, mode=None):
    """torch.compile(fn) as train() calls it, with --compile-mode (or `mode`) and bench.py's --compile-backend."""
    if args.compile_backend != "inductor":  # the backends but inductor take no mode
        return torch.compile(fn, dynamic=False, backend=args.compile_backend)
    return torch.compile(fn, dynamic=False, mode=mode or args.compile_mode)


def bench_images(args) -> du.ImageData:
    """The synthetic training images the steps draw from and the augmentation epoch covers: CIFAR-100's
    50,000 unless --train-size says how many."""
    return du.make_synthetic(args.train_size or 50_000, train=True)


def bench_data(args, cfg, env, data: du.ImageData) -> du.CheckedData:
    """The data as build_training takes them: --steps whole steps of training images (one timed epoch; fewer
    if `data` holds fewer; whole, so that compile sees one shape), and test images (unused), measured."""
    n = min(args.steps, len(data) // args.batch_size) * args.batch_size
    if n == 0:
        raise UserError(f"--batch-size {args.batch_size} exceeds the {len(data)} training images")
    train, test = (dataclasses.replace(data, images=data.images[:k], labels=data.labels[:k])
                   for k in (n, 10_000))
    return du.CheckedData(train, test, du.measure_data(train, test), {},
                          du.loader_device(cfg, env, train, test))


def bench_ours(args, env, cfg, checked: du.CheckedData, data: du.ImageData, on_step_time) -> dict:
    """The recipe's step timed; on_step_time(step_s) as soon as that figure exists (bench.py writes its JSON then:
    a run cut later keeps its headline), then the phases, MFU's FLOPs, memory and an epoch's augmentation."""
    device, accum, cuda = env.device, cfg.accumulation_steps, env.device.type == "cuda"
    training = train_ddp.build_training(cfg, env, checked)
    step_log = StepLog(0, device)  # the recipe's: the step's phases timed, DDP's all-reduce by its hook
    model = wrap(training.model, args, env, args.compile, step_log=step_log)
    log(f"timing the recipe's step: WRN-{cfg.depth}-{cfg.widen_factor}, batch {cfg.batch_size} over "
        f"{env.world_size} {device.type} process(es){f' in {accum} micro-batches' if accum > 1 else ''}, "
        f"{args.steps} steps after {args.warmup} warm-up")
    clock, loop = Clock(device), TrainSteps(model, training, cfg, step_log=step_log)
    loop.run(args.warmup)
    log("warm-up done: the timed steps begin")
    step_s = loop.seconds_per_step(args.steps)
    on_step_time(step_s)
    peak_memory = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None  # training, data included
    phase_steps = max(10, args.steps // 2)
    phases = time_phases(model, training, cfg, phase_steps)
    phases["exposed_comm_s"] = None
    if env.world_size > 1 and not args.compile:  # DDP minus no_sync: the communication not hidden by backward
        with model.no_sync():
            phases["exposed_comm_s"] = max(0.0, phases["fwd_bwd_s"] - time_phases(model, training, cfg,
                                                                                  phase_steps)["fwd_bwd_s"])
    phases.update(steps=phase_steps, what="a separate run of the recipe's loop with timer marks between the "
                  "phases of each step (data: LR, batch, split, copy, normalisation; fwd_bwd: all "
                  "micro-batches and the loss sums; optimizer: the scaler's step and update; exposed_comm: "
                  "fwd_bwd with DDP minus fwd_bwd under no_sync); left out: the stop check every 10 steps, "
                  "and an epoch's start and end")
    flops = flops_per_image(training.model, device, cfg.amp_dtype)
    # One full epoch of augmentation on one device (all of bench_images, this rank's batch size).
    one = dataclasses.replace(cfg, flags={**cfg.flags, "batch_size": cfg.per_rank_batch, "seed": 0},
                              accumulation_steps=1, eval_batch=cfg.per_rank_batch, num_workers=0)
    everything, _, _ = du.build_loaders(du.CheckedData(data, checked.test, checked.spec, {}, device), one,
                                        dataclasses.replace(env, rank=0, world_size=1))
    everything.batch_sampler.set_epoch(1)
    next(iter(everything))  # warm-up
    t0 = clock.mark()
    for _ in everything:
        pass
    aug_epoch_s = clock.seconds(t0, clock.mark())
    return {"step_s": step_s, "what": "train_ddp.train_one_epoch on build_training's Training: an epoch of "
            "`steps` steps, its start and end included (several epochs past the training images' count), "
            "after `warmup` untimed steps", "steps": args.steps, "warmup": args.warmup, "accum_steps": accum,
            "phases": phases, "augment_epoch_s": aug_epoch_s, "augment_epoch_images": len(data.labels),
            "flops_per_image": flops, "peak_memory_gib": peak_memory}


# ----------------------------------------------------------------------------- speed candidates

def candidates(args, env, data: du.ImageData, write) -> dict:
    """Ways to make the recipe's step faster, each timed as bench_ours times the step (train_one_epoch, --steps
    after --warmup, a fresh model, compiled afresh), side by side in this process, each as a ratio to the first,
    today's default (the flags given). In order of value, so that a run cut short keeps the first; `write(result)`
    after each. Then what evaluating the test set costs an epoch. --deterministic runs in a process of its own
    (bench.py --deterministic: cuBLAS reads its workspace setting when it makes its first handle, and the rows here
    share one)."""
    per_gpu = args.batch_size // env.world_size
    rows = [("default", {}, False), ("compile-mode reduce-overhead", {"compile_mode": "reduce-overhead"}, False),
            (f"batch {2 * per_gpu} per GPU", {"batch_size": 2 * args.batch_size}, False),
            ("optimizer step compiled", {}, True),
            ("default, again", {}, False),  # the spread of one configuration timed twice in one run
            # last: its autotuning may take minutes
            ("compile-mode max-autotune-no-cudagraphs", {"compile_mode": "max-autotune-no-cudagraphs"}, False)]
    result = {"what": "images per second of the recipe's train_one_epoch, --steps after --warmup, each row with a "
              "fresh model and compile; ratio: to the mean of the default rows run so far", "rows": {}}
    eval_model = None
    for name, flags, optimizer_compiled in rows:
        torch._dynamo.reset()  # a fresh compile: the cache of one model's forward holds at most 8 graphs
        cfg = recipe_config(args, env, **flags)
        candidate = argparse.Namespace(**{**vars(args), **flags})
        checked = bench_data(candidate, cfg, env, data)
        training = train_ddp.build_training(cfg, env, checked)
        model = wrap(training.model, candidate, env, args.compile)
        if optimizer_compiled:
            compile_optimizer_step(training.optimizer, args)
        loop, clock = TrainSteps(model, training, cfg), Clock(env.device)
        # Dynamo's and Inductor's counters: graphs compiled (a recompile while timed is one more), and the graphs
        # that reduce-overhead ran without CUDA graphs (DDP can make it skip them, with no more than a warning).
        graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
        start = clock.mark()
        loop.run(args.warmup)
        warmup_s = clock.seconds(start, clock.mark())
        warm_graphs = counters["stats"]["unique_graphs"]
        step_s = loop.seconds_per_step(args.steps)
        row = {"flags": flags, "optimizer_compiled": optimizer_compiled, "step_s": step_s,
               "images_per_s": cfg.batch_size / step_s, "warmup_s": warmup_s, "peak_memory_gib":
               torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else None,
               "graphs": counters["stats"]["unique_graphs"] - graphs,
               "graphs_while_timed": counters["stats"]["unique_graphs"] - warm_graphs,
               "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips}
        result["rows"][name] = row
        default = statistics.mean(r["images_per_s"] for n, r in result["rows"].items() if n.startswith("default"))
        for other in result["rows"].values():
            other["ratio"] = other["images_per_s"] / default
        log(f"candidate {name}: {row['images_per_s']:.0f} img/s, {row['ratio']:.3f}x the default "
            f"(warm-up {warmup_s:.1f} s; {row['graphs']} graphs compiled, {row['graphs_while_timed']} while timed; "
            f"{row['cudagraph_skips']} skipped CUDA graphs)")
        write(result)
        if name == "default":  # the evaluation's cost, with this model: the test set, as each epoch scores it
            eval_model = compile_fn(training.model, args) if args.compile else training.model
            result["evaluation"] = time_evaluation(eval_model, training, cfg, env, row["images_per_s"],
                                                   count=len(checked.test))
            write(result)
        del model, training, loop, checked
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(env.device)
    return result


def compile_optimizer_step(optimizer, args) -> None:
    """optimizer.step compiled into one graph (torch.compile's tutorial), in place of fused SGD: its LR a tensor,
    filled with the float train_one_epoch sets, so that a new LR each step is no recompile."""
    lrs = []
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = False, None
        lrs.append(torch.tensor(float(group["lr"]), device=group["params"][0].device))
        group["lr"] = lrs[-1]
    step = compile_fn(optimizer.step, args, mode="default")

    def step_with_tensor_lr(*a, **kw):
        for group, lr in zip(optimizer.param_groups, lrs):
            if not isinstance(group["lr"], torch.Tensor):
                lr.fill_(group["lr"])
                group["lr"] = lr
        return step(*a, **kw)
    optimizer.step = step_with_tensor_lr


def time_evaluation(eval_model, training, cfg, env, images_per_s: float, *, count: int) -> dict:
    """train_ddp.evaluate over the test split (after one untimed pass), against an epoch of 50,000 training
    images at `images_per_s`: what evaluating every epoch costs the run."""
    loader, clock = training.test_loader, Clock(env.device)

    def evaluate_once():
        return train_ddp.evaluate(eval_model, loader, normalize=training.normalize, amp_dtype=cfg.amp_dtype,
                                  expected_count=count, tta=cfg.tta)
    evaluate_once()
    start = clock.mark()
    evaluate_once()
    eval_s = clock.seconds(start, clock.mark())
    epoch_s = 50_000 / images_per_s
    out = {"eval_s": eval_s, "images": count, "train_epoch_s": epoch_s, "share": eval_s / (eval_s + epoch_s),
           "what": "evaluate() of `images` test images (after one untimed pass), against a 50,000-image epoch "
           "at the default row's rate"}
    log(f"evaluation: {count} test images in {eval_s:.3f} s, against {epoch_s:.2f} s for a 50,000-image epoch: "
        f"{out['share'] * 100:.1f}% of an epoch with it")
    return out


# ------------------------------------------------------------------------- the modern recipe's augmentation

MODERN_AUGMENT = dict(auto_augment="ta_wide", random_erase=0.25, mixup_alpha=0.2, cutmix_alpha=1.0)


def augment_share(args, env, data: du.ImageData) -> dict:
    """On each loader (the device's, and DataLoader workers), the recipe's step (train_one_epoch) with and
    without MODERN_AUGMENT, --steps after --warmup, and the loader alone over the same steps (its batches, no
    training): the augmentation's cost per step, and its share of the step with it."""
    clock, rows = Clock(env.device), {}
    for loader in ("gpu", "torch"):
        row = {}
        for name, flags in (("plain", {}), ("modern", MODERN_AUGMENT)):
            cfg = recipe_config(args, env, loader=loader, **flags)
            checked = bench_data(args, cfg, env, data)
            training = train_ddp.build_training(cfg, env, checked)
            loop = TrainSteps(wrap(training.model, args, env, args.compile), training, cfg)
            loop.run(args.warmup)
            step_s = loop.seconds_per_step(args.steps)
            batches = training.train_loader
            batches.batch_sampler.set_epoch(1)
            start, n = clock.mark(), 0
            for images, labels in batches:
                images.to(env.device, non_blocking=True), labels.to(env.device, non_blocking=True)
                n += 1
            row[name] = {"step_s": step_s, "loader_s": clock.seconds(start, clock.mark()) / max(n, 1)}
        modern, plain = row["modern"], row["plain"]
        row["augment_s"] = modern["loader_s"] - plain["loader_s"]  # the loader's extra time per step
        row["augment_share"] = row["augment_s"] / modern["step_s"]
        row["step_ratio"] = modern["step_s"] / plain["step_s"]
        rows[loader] = row
        log(f"--loader {loader}: step {plain['step_s'] * 1e3:.1f} ms plain, {modern['step_s'] * 1e3:.1f} ms "
            f"with the modern augmentation ({row['step_ratio']:.2f}x); its loader alone "
            f"{plain['loader_s'] * 1e3:.1f} -> {modern['loader_s'] * 1e3:.1f} ms a step: the augmentation is "
            f"{row['augment_share'] * 100:.1f}% of the step")
    return {"augment": MODERN_AUGMENT, "what": "per step: the recipe's train_one_epoch with and without the "
            "augmentation, and the training loader alone (its batches copied to the device, no training); "
            "augment_share: the loader's extra time over the step with it (on GPUs the device loader's ops "
            "queue behind the step, so the step ratio is the cost that counts)", **rows}


# ----------------------------------------------------------------------------- does the loader keep up?

def loader_check(args, env) -> dict:
    """The run's training loader read on every rank at once without training (tools/loader_check.read_rate), then
    the recipe's step on images of the model's input size already on the device; the verdict, and its fixes."""
    cfg = recipe_config(args, env, dataset=args.dataset)
    data = du.load_checked_data(train_ddp.load_data, cfg, env, None)
    loader, _, _ = du.build_loaders(data, cfg, env, transforms=train_ddp.build_transforms(cfg, data.spec))
    in_memory, device_loader = isinstance(data.train, du.ImageData), data.device is not None
    workers = ("the device loader" if device_loader else
               f"{cfg.num_workers} DataLoader worker{'s' if cfg.num_workers != 1 else ''} per rank")
    fs = file_system(cfg.data_dir)
    log(f"loader check: {workers} read {data.source}{'' if in_memory else f' (on {fs})'}, {cfg.per_rank_batch} "
        f"images per rank and step, {args.steps} steps after {args.warmup} untimed")
    read = read_rate(loader, env.device, warmup=args.warmup * cfg.accumulation_steps,
                     batches=args.steps * cfg.accumulation_steps)
    del loader
    rates = all_gather((read["images"] / read["seconds"], platform.node()))
    # The step, fed from memory: --steps of distinct images (at most 1 GiB of them), as the loader shapes them.
    channels, height, width = read["shape"]
    n = max(1, min(args.steps, 2**30 // (cfg.batch_size * channels * height * width))) * cfg.batch_size
    step_cfg = recipe_config(args, env, loader="gpu", workers=0)
    images = du.ImageData(torch.randint(0, 256, (n, channels, height, width), dtype=torch.uint8),
                          torch.randint(0, data.spec.num_classes, (n,)), num_classes=data.spec.num_classes)
    spec = dataclasses.replace(data.spec, channels=channels, height=height, width=width)
    checked = du.CheckedData(images, images, spec, {}, du.loader_device(step_cfg, env, images, images))
    training = train_ddp.build_training(step_cfg, env, dataclasses.replace(checked, train=None))
    training.train_loader = du.build_loaders(checked, step_cfg, env)[0]  # no transform: the images as they are
    loop = TrainSteps(wrap(training.model, args, env, args.compile), training, step_cfg)
    loop.run(args.warmup)
    step_s = loop.seconds_per_step(args.steps)
    per_rank = [rate for rate, _ in rates]
    verdict = judge(read_per_rank=per_rank, step_s=step_s, per_rank_batch=cfg.per_rank_batch,
                    overlapped=not device_loader and cfg.num_workers > 0)
    cpus = max(1, cpus_per_rank(env))  # rank 0's, which says these lines
    fixes = name_fixes(device_loader=device_loader, workers=cfg.num_workers, cpus=cpus, in_memory=in_memory,
                       data_dir=cfg.data_dir, fs=fs)
    slowest = min(range(env.world_size), key=per_rank.__getitem__)
    consumed = cfg.per_rank_batch / step_s
    log(f"loader check: the loader delivers {statistics.median(per_rank):.0f} img/s per rank (the median; the "
        f"slowest: rank {slowest} on {rates[slowest][1]}, {per_rank[slowest]:.0f}), {sum(per_rank):.0f} img/s in all")
    log(f"loader check: the step consumes {consumed:.0f} img/s per rank, {consumed * env.world_size:.0f} img/s in "
        f"all ({env.world_size} {env.device.type} process(es), the images already on the device)")
    log(say_verdict(verdict, fixes))
    return {"loader": workers, "data": data.source, "file_system": fs, "images_per_s_per_rank": per_rank,
            "hosts": [host for _, host in rates], "cpus_per_rank": cpus, "step_s": step_s,
            "step_images_per_s_per_rank": consumed, **verdict, "fixes": [] if verdict["keeps_up"] else fixes,
            "what": "images per second per rank: the training loader's batches copied to the device, after "
            "`warmup` untimed steps, all ranks at once; the step: the recipe's train_one_epoch on images of the "
            "model's input size already on the device (no loader cost); wait_share: the step's predicted wait"}


# ----------------------------------------------------------------------------- the original script's pipeline

def bench_original(args, env, cfg, data, checked) -> dict:
    device, per_rank = env.device, args.batch_size // env.world_size
    # The recipe's model and SGD (build_training; its loaders never started), as the original script had
    # them: the weights not channels_last, and SGD's default implementation, not the fused one (same on CPU).
    training = train_ddp.build_training(cfg, env, dataclasses.replace(checked, train=None, device=None))
    model = wrap(training.model.to(memory_format=torch.contiguous_format),
                 argparse.Namespace(**{**vars(args), "comm_hook": "none"}), env, compile_model=False)  # no hook
    for group in training.optimizer.param_groups:
        group["fused"] = None
    amp = torch.float16 if device.type == "cuda" else None  # the original: fp16 autocast on CUDA
    scaler = torch.amp.GradScaler(device.type, enabled=amp is not None)
    log(f"timing the original script's pipeline: {args.workers} DataLoader workers per rank, {args.steps} "
        f"steps after {args.warmup} warm-up")
    with contextlib.closing(original_batches(data, per_rank, env, args.workers, device)) as batches:
        step_s = original_steps(model, batches, training.optimizer, scaler, amp, device, args.steps,
                                args.warmup)
    return {"step_s": step_s}


# ----------------------------------------------------------------------------- main

def report_ours(ours: dict, device, world_size: int, peak_note: str) -> None:
    ms = lambda s: "n/a" if s is None else f"{s * 1e3:.2f} ms"  # noqa: E731
    ph, ips = ours["phases"], ours["images_per_s"]
    log(f"ours: {ips:.0f} img/s, {ips / world_size:.0f} img/s per {device.type}, step {ms(ours['step_s'])} "
        f"(the recipe's train_one_epoch)")
    log(f"ours, phases (a separate run of the same step, with timer marks between its phases): data "
        f"{ms(ph['data_s'])}, fwd+bwd {ms(ph['fwd_bwd_s'])}, optimizer {ms(ph['optimizer_s'])}, exposed comm "
        f"{ms(ph['exposed_comm_s'])}")
    log(f"augmentation of one {ours['augment_epoch_images']}-image epoch on one {device.type}: "
        f"{ours['augment_epoch_s'] * 1e3:.1f} ms")
    mfu = "n/a" if ours["mfu"] is None else f"{ours['mfu'] * 100:.1f}%"
    mem = "n/a" if ours["peak_memory_gib"] is None else f"{ours['peak_memory_gib']:.2f} GiB"
    log(f"MFU: {mfu} ({ours['flops_per_image'] / 1e9:.2f} GFLOP per image fwd+bwd; {peak_note}); "
        f"peak memory {mem}")


def main(args):
    resolve_shape(args)
    for name, least in (("steps", 1), ("warmup", 0), ("rounds", 1)):  # this script's own flags
        if getattr(args, name) < least:
            raise UserError(f"--{name} must be at least {least}, got {getattr(args, name)}")
    if args.dataset != "synthetic" and not args.loader_check:  # bench_data and the CPU checks make their own
        raise UserError("bench.py times the step on synthetic images in memory: leave --dataset out")
    env = train_ddp.init_distributed(args.device, args.timeout)  # rank, device, process group: NCCL or gloo
    train_ddp.choose_kernels(deterministic=args.deterministic)
    try:
        if args.cpu_checks:  # the recipe's loop on CPU, without DDP
            env = dataclasses.replace(env, device=torch.device("cpu"))
            cfg = recipe_config(args, env, device="cpu", amp="off", loader="gpu", workers=0, micro_batch=None,
                                compile=False)
        else:
            cfg = recipe_config(args, env)
        device = env.device
        result = {"config": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                  else cpu_name(), "world_size": env.world_size, "torch": torch.__version__,
                  "amp_dtype": str(cfg.amp_dtype), "hosts": sorted(set(all_gather(platform.node())))}
        device_name = "".join(c if c.isalnum() else "_" for c in result["device"])[:40]
        path = args.json or os.path.join("runs", "bench", f"bench-{device_name}-{env.world_size}x.json")

        def write(partial=None):  # runs/ is git-ignored
            if env.is_main:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                write_json(path, result if partial is None else {**result, "candidates": partial})
        if args.loader_check:
            result["loader_check"] = loader_check(args, env)
        elif args.comm_hooks:
            if env.world_size < 2:
                raise UserError("--comm-hooks times DDP's all-reduce: launch at least 2 processes with torchrun")

            images = bench_images(args)  # made once, shared by every hook's model

            def build(flags):  # a fresh model with these flags, as bench_ours builds one
                cfg = recipe_config(args, env, **flags)
                training = train_ddp.build_training(cfg, env, bench_data(args, cfg, env, images))
                return wrap(training.model, argparse.Namespace(**{**vars(args), **flags}), env, args.compile), \
                    training, cfg
            result["comm_hooks"] = comm_hooks(args, env, build)
        elif args.candidates:
            if not args.compile:
                raise UserError("--candidates compares compile modes and a compiled optimizer step: add --compile")
            result["candidates"] = candidates(args, env, bench_images(args), write)
        elif args.augment_share:
            result["augment_share"] = augment_share(args, env, bench_images(args))
        elif args.cpu_checks:
            log(f"cpu checks: WRN-{args.depth}-{args.widen_factor}, batch {args.batch_size}, {args.rounds} "
                f"rounds (about two minutes on 2 cores with the defaults)")
            t0 = time.perf_counter()
            result["cpu_checks"] = cpu_checks(args, cfg, env)
            report_cpu_checks(result["cpu_checks"], time.perf_counter() - t0)
        else:
            data = bench_images(args)
            checked = bench_data(args, cfg, env, data)
            peak, peak_note = peak_flops(device, cfg.amp_dtype)

            def headline(step_s):
                ips = args.batch_size / step_s
                result["ours"] = {"step_s": step_s, "images_per_s": ips, "images_per_s_per_gpu": ips / env.world_size}
                write()
            ours = bench_ours(args, env, cfg, checked, data, on_step_time=headline)
            ours.update(result["ours"])
            ours["mfu"] = ours["flops_per_image"] * ours["images_per_s_per_gpu"] / peak if peak else None
            result["ours"] = {**ours, "peak_note": peak_note}
            write()
            report_ours(ours, device, env.world_size, peak_note)
            if args.compare_original:
                original = bench_original(args, env, cfg, data, checked)
                original["images_per_s"] = args.batch_size / original["step_s"]
                result["original"] = original
                result["speedup_vs_original"] = ours["images_per_s"] / original["images_per_s"]
                log(f"the original script's pipeline: {original['images_per_s']:.0f} img/s; ours is "
                    f"{result['speedup_vs_original']:.2f}x")
        write()
        log(f"wrote {path}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    # SIGTERM and Ctrl-C: out at once in one line; bad input: one line; --recipe NAME as in train_ddp.py.
    # --loader-check reads the run's data with the run's flags: train_ddp.py's defaults, not bench.py's
    sys.exit(run_tool(main, get_args_parser(loader_check="--loader-check" in sys.argv), utils.RECIPES))
