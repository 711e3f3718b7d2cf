"""Train a WideResNet on CIFAR-100 with DistributedDataParallel.

    python train_ddp.py --dataset synthetic --epochs 1                # one process (GPU or CPU)
    torchrun --standalone --nproc_per_node=4 train_ddp.py             # one node, 4 GPUs
    sbatch jobs/multigpu.sh                                           # Slurm

The same file runs under plain python and under torchrun: the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK) says whether this is one process of many. On CUDA each
process drives the GPU of its LOCAL_RANK with NCCL; without CUDA it runs on CPU with gloo.

train() is the recipe, top to bottom: the run's shape and LR, the data, the model, the resume,
then for each epoch train_one_epoch() and evaluate(), a record and a checkpoint, and a summary.
The two places marked ADAPT are where you plug in your own model and data: the data describe
themselves (channels, size, classes, mean and std), and the model, the normalisation and the
augmentation follow them. For a task other than classification, also change loss_fn in train()
and the metrics in evaluate().
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dataset_utils
import train_utils as utils
from model import WideResNet, depth_arg, width_arg


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="CIFAR-100 DDP example with Mixed Precision",
                                epilog="The defaults are the original script's 5-epoch smoke run; the full recipe "
                                       "(the WRN paper's WRN-16-8, 200 epochs) is RECIPE in jobs/lib.sh, which the job "
                                       "scripts run.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # The original script's flags keep their meaning.
    p.add_argument("--batch-size", type=int, default=512, help="global batch size, split evenly over all ranks")
    p.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
    p.add_argument("--base-lr", type=float, default=0.01, help="learning rate tuned for --reference-batch-size on one GPU")
    p.add_argument("--target-accuracy", type=float, default=0.85, help="validation accuracy (fraction) that counts towards early stopping")
    p.add_argument("--patience", type=int, default=2, help="stop after this many consecutive epochs at or above the target")
    # Model.
    p.add_argument("--depth", type=depth_arg, default=16, help="WideResNet depth, 6n+4")
    p.add_argument("--widen-factor", type=width_arg, default=8, help="WideResNet width multiplier k")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout between the convs of each block")
    # Data.
    p.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100", help="synthetic: learnable generated data of CIFAR-100's shape, no download")
    p.add_argument("--data-dir", default="./datasets", help="where cifar-100-python.tar.gz is, or is downloaded to")
    p.add_argument("--train-size", type=int, default=0, help="use only the first N training samples (0: all)")
    p.add_argument("--test-size", type=int, default=0, help="use only the first N test samples (0: all)")
    p.add_argument("--loader", choices=["auto", "gpu", "torch"], default="auto", help="gpu: data on the device, augmented there; torch: DataLoader with CPU workers; auto: gpu on CUDA")
    p.add_argument("--workers", type=int, default=-1, help="DataLoader workers per rank with --loader torch (-1: the rank's share of the CPUs, at most 8)")
    # Optimisation.
    p.add_argument("--micro-batch", type=int, default=None, help="most samples per forward/backward on one rank; more are reached by gradient accumulation (default: no cap)")
    p.add_argument("--reference-batch-size", type=int, default=512, help="the batch size --base-lr was tuned for")
    p.add_argument("--lr-scaling", choices=["linear", "sqrt", "none"], default="linear", help="how the LR grows with batch-size / reference-batch-size")
    p.add_argument("--lr-schedule", choices=["cosine", "step"], default="cosine", help="after warm-up: cosine to 0, or the WRN paper's x0.2 steps at 30/60/80%%")
    p.add_argument("--warmup-epochs", type=float, default=1.0, help="linear LR warm-up from ~0, in epochs")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=False, help="Nesterov momentum")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="label smoothing of the training loss")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks' batches (SyncBatchNorm; CUDA only)")
    # Run.
    p.add_argument("--out-dir", default="./runs/wrn", help="checkpoint, metrics and summary go here; a checkpoint here is resumed")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights, the data order and augmentation")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA if available, else CPU")
    p.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto", help="mixed precision; auto: bf16 where supported, fp16 on older GPUs, off on CPU")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a hung collective or rendezvous fails")
    p.add_argument("--log-every", type=int, default=50, help="progress line every N steps in batch logs (on a terminal: a live line; 0: none)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps within an epoch (0: at epoch ends only)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="how many recent checkpoints to keep, newest first")
    p.add_argument("--stop-after-epoch", type=int, default=0, help="end this run after that epoch, checkpointed, to resume in a later job (0: never)")
    p.add_argument("--evaluate", action="store_true", help="evaluate the checkpoint in --out-dir on its test set and exit (other flags: from the checkpoint)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slower start, faster steps)")
    p.add_argument("--tensorboard", action="store_true", help="also log the epoch metrics to out-dir/tensorboard (pip install tensorboard)")
    return p


def build_model(args, data: dataset_utils.DataSpec) -> nn.Module:
    # ADAPT (1/2): your model here, taking its input channels and classes from `data`; and in model_config
    # what fixes its shapes (a checkpoint must match them; "name" is what messages call it).
    return WideResNet(args.depth, args.widen_factor, num_classes=data.num_classes, dropout=args.dropout,
                      in_channels=data.channels)


def model_config(args, data: dataset_utils.DataSpec) -> dict:
    return {"name": f"WRN-{args.depth}-{args.widen_factor}", "depth": args.depth, "widen_factor": args.widen_factor,
            "in_channels": data.channels, "num_classes": data.num_classes}


def load_data(args, env, train: bool = True):
    """The (train, test) splits: dataset_utils.ImageData (uint8 images N x C x H x W, int64 labels) for data
    that fit in memory, or Datasets of (uint8 C x H x W tensor, label) for --loader torch. train: None if
    not asked for. The rest follows from what this returns: see dataset_utils.describe_data."""
    # ADAPT (2/2): your data here.
    if args.dataset == "cifar100":  # one process per node fetches and checks it (the data dir may be node-local)
        utils.call_and_agree(dataset_utils.prepare_cifar100, args.data_dir, here=env.local_rank == 0)
    return (dataset_utils.load_split(args.dataset, args.data_dir, True, args.train_size) if train else None,
            dataset_utils.load_split(args.dataset, args.data_dir, False, args.test_size))


def train_step(model, images, labels, *, normalize, optimizer, scaler, loss_fn, amp_dtype, micro_sizes,
               step_samples):
    """One optimizer step on this rank's share of a global batch of `step_samples` samples, in micro-batches
    of `micro_sizes` (EpochSampler.step_split); `loss_fn` sums. Returns the step's loss sums on the device
    (utils.loss_stats): reading the loss on the host here would stall the GPU every step."""
    device = normalize.scale.device
    images = normalize(images.to(device, non_blocking=True))
    labels = labels.to(device, non_blocking=True)
    optimizer.zero_grad(set_to_none=True)
    # DDP averages the ranks' gradients, so each rank divides its sum by the step's samples per rank:
    # the update is then the mean over the whole global batch, even when the last step is uneven.
    per_rank = step_samples / (dist.get_world_size() if dist.is_initialized() else 1)
    stats, kept_buffers = 0, None
    for k, (x, y) in enumerate(zip(images.split(micro_sizes), labels.split(micro_sizes))):
        with utils.sync_gradients(model, enabled=k == len(micro_sizes) - 1):  # DDP all-reduces in the last one
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = loss_fn(model(x), y)  # an empty micro-batch gives 0 and leaves BN's statistics alone
            scaler.scale(loss / per_rank).backward()
        stats = stats + utils.loss_stats(loss.detach(), y.numel())
        # Micro-step k plays virtual rank r + k x world_size (EpochSampler). In a run of that many ranks,
        # rank 0's BatchNorm running statistics are the ones kept (DDP broadcasts them), and they saw only
        # virtual rank 0's batch: so each rank keeps its micro-step 0's and undoes the others'.
        if len(micro_sizes) > 1 and k == 0:
            kept_buffers = [b.detach().clone() for b in utils.unwrap(model).buffers()]
    utils.restore_buffers(model, kept_buffers)  # a no-op if nothing was kept
    scaler.step(optimizer)  # with fp16, skipped when the gradients hold inf/NaN
    scaler.update()
    return stats


def train_one_epoch(model, loader, *, optimizer, scaler, loss_fn, normalize, epoch, progress, run) -> bool:
    """Train the rest of `epoch` from progress.position. Returns True if the ranks agreed to stop
    (a stop request), with a checkpoint saved. Raises UserError if the loss went non-finite."""
    args, env, n = run.args, run.env, run.n_train
    model.train()
    loader.batch_sampler.set_epoch(epoch, start=progress.position)  # a new order per epoch; after a resume, the rest
    # loss sum over finite losses, their n, and all n; a resumed epoch's sums so far sit on rank 0.
    sums = torch.tensor(progress.sums if env.is_main else [0.0] * 3, dtype=torch.float64, device=env.device)
    steps_per_epoch = progress.step + len(loader.batch_sampler)  # steps done + the steps left from the start set
    t0 = time.perf_counter() - progress.elapsed_s
    for images, labels in loader:
        step_samples, micro_sizes = loader.batch_sampler.step_split(progress.position)  # the last step may be short
        done = progress.position + step_samples
        # The LR follows the samples seen: the step's start and end in epochs (epoch - 1 + fraction done),
        # so a resume with another batch size keeps its schedule.
        utils.set_lr(optimizer, run.peak_lr * utils.lr_factor(epoch - 1 + progress.position / n, epoch - 1 + done / n,
                                                              epochs=args.epochs, warmup_epochs=args.warmup_epochs,
                                                              schedule=args.lr_schedule))
        sums += train_step(model, images, labels, normalize=normalize, optimizer=optimizer, scaler=scaler,
                           loss_fn=loss_fn, amp_dtype=run.amp_dtype, micro_sizes=micro_sizes, step_samples=step_samples)
        progress.position, progress.step = done, progress.step + 1
        run.progress_log.update(epoch, progress.step, steps_per_epoch, done, sums, t0)
        if utils.stop_or_checkpoint_mid_epoch(run, progress, sums, t0=t0, allow_nonfinite=scaler.is_enabled()):
            return True
    # Summing over ranks waits for the slowest, like the original script's barrier, so the time is honest.
    progress.sums, progress.elapsed_s = utils.all_reduce_sum(sums).tolist(), time.perf_counter() - t0
    run.progress_log.clear()
    return False


@torch.no_grad()
def evaluate(model, loader, *, normalize, device, amp_dtype, expected_count: int) -> dict:
    """Loss, top-1 and top-5 over the whole test set, exact for any world size: each rank scores its shard, and
    the sums (not per-rank means) are all-reduced, so uneven shards weigh right. `model` is the bare model: DDP's
    forward may broadcast, and a rank with an empty shard would not join. The count check: every image once."""
    utils.broadcast_buffers(model)  # rank 0's BatchNorm statistics on every rank: one model, the one saved
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss*n, top-1, top-5, n
    for images, labels in loader:
        images = normalize(images.to(device, non_blocking=True))
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
        hits = logits.topk(min(5, logits.size(1)), dim=1).indices == labels[:, None]  # is the k-th best guess right?
        batch_count = torch.full((), labels.numel(), dtype=torch.float64, device=device)  # on the device: no sync
        sums += torch.stack([loss.double(), hits[:, 0].sum().double(), hits.any(dim=1).sum().double(), batch_count])
    loss_sum, top1, top5, count = utils.all_reduce_sum(sums).tolist()
    if int(count) != expected_count:
        raise RuntimeError(f"evaluation scored {int(count)} images, but the test set has {expected_count}")
    return {"val_loss": loss_sum / count, "val_acc": top1 / count, "val_top5": top5 / count, "val_count": int(count)}


def train(args, env, ckpt, ckpt_path, notes, amp_dtype, lock) -> int:
    """The recipe. Every rank runs all of it; rank 0 alone prints and writes."""
    device = env.device
    # ------------------------------------------------------------------ the run's shape: ranks, batch, LR
    ranks = utils.gather_ranks(env)  # every rank's host and device, for the log and run.json
    per_rank_batch = args.batch_size // env.world_size  # --batch-size is global: each rank takes its share
    accum_steps = utils.accumulation_steps(per_rank_batch, args.micro_batch)  # micro-steps of at most --micro-batch
    lr = utils.scaled_lr(args.base_lr, args.batch_size, args.reference_batch_size, args.lr_scaling)  # LR for the global batch
    config = utils.run_config(args, env, ranks=ranks, per_rank_batch=per_rank_batch, accum_steps=accum_steps, lr=lr,
                              amp_dtype=amp_dtype)  # every flag, and what this run made of them
    utils.log_start(config, env, notes)  # the original script's first lines, the config, the batch split and LR

    # ------------------------------------------------------------------ data
    train_data, test_data = utils.call_and_agree(load_data, args, env)  # an error on any rank: raised on all
    data = utils.call_and_agree(dataset_utils.describe_data, train_data, test_data)  # channels, size, classes, stats
    config["data_spec"] = utils.log_data(data, n_train=len(train_data), n_test=len(test_data))
    fingerprints = {"train": dataset_utils.fingerprint(train_data), "test": dataset_utils.fingerprint(test_data)}
    utils.call_and_agree(utils.check_same_data, ckpt, args, data.shape(), fingerprints)  # never continue on other data
    utils.call_and_agree(utils.check_same_model, ckpt, ckpt_path, model_config(args, data))
    # Training: each rank's share of every global batch. Test: rank r scores images r, r + world_size, ...
    train_loader, test_loader = dataset_utils.build_loaders(
        train_data, test_data, batch_size=args.batch_size, rank=env.rank, world_size=env.world_size,
        accum_steps=accum_steps, eval_batch=config["micro_batch_size"], seed=args.seed, workers=config["num_workers"],
        pin_memory=device.type == "cuda", device=dataset_utils.data_device(args.loader, device, train_data, test_data))
    normalize = dataset_utils.Normalize(data.mean, data.std, device, channels_last=device.type == "cuda")  # uint8 -> float

    # ------------------------------------------------------------------ model and optimizer
    utils.seed_everything(args.seed)  # the same initial weights on every rank
    model = build_model(args, data)
    if args.sync_bn:  # before DDP, so that DDP all-reduces the statistics within each forward
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = utils.to_device(model, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=args.nesterov,
                                weight_decay=args.weight_decay, fused=device.type == "cuda")  # LR: set every step
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bf16 needs none
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing, reduction="sum")  # train_step averages
    utils.seed_everything(args.seed + env.rank)  # dropout then differs across ranks, as it should

    # ------------------------------------------------------------------ resume, then DDP
    progress = utils.restore_checkpoint(ckpt, ckpt_path, model=model, optimizer=optimizer, scaler=scaler, args=args,
                                        env=env, config=config)  # where training stands
    bare_model = eval_model = model  # evaluate() needs no DDP (see there)
    if env.distributed:  # DDP all-reduces (averages) the gradients in backward; bucket views spare a copy
        model = DDP(model, device_ids=[env.local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if args.compile:  # a static graph per shape (the last batch is smaller)
        model, eval_model = torch.compile(model, dynamic=False), torch.compile(bare_model, dynamic=False)

    def save_state():
        """Write a checkpoint. Every rank calls this (it gathers their RNG states); rank 0 writes, unless another
        run took the out-dir, and all ranks leave together if that write fails."""
        state = utils.training_state(bare_model, optimizer=optimizer, scaler=scaler, progress=progress, config=config,
                                     model_config=model_config(args, data), fingerprints=fingerprints, device=device)
        utils.write_on_main(env, lambda: utils.save_checkpoint(args.out_dir, state, args.keep_checkpoints),
                            what=f"the checkpoint {utils.describe_progress(progress)}", out_dir=args.out_dir, lock=lock)

    # ------------------------------------------------------------------ train and evaluate, epoch by epoch
    # A full disk is refused now, not after an epoch's work; then the run's files: metrics.jsonl, run.json, ...
    utils.call_and_agree(utils.check_room_for_checkpoint, args.out_dir, bare_model, optimizer, here=env.is_main)
    records = utils.Records(args, env, config=config, ranks=ranks, history=progress.history, lock=lock)
    with utils.StopRequest() as stop:  # SIGUSR1/SIGTERM/Ctrl-C and the stop file, caught while the loop runs
        run = utils.RunContext(args, env, amp_dtype, peak_lr=lr, n_train=len(train_data), stop=stop,
                               progress_log=utils.ProgressLog(args.log_every), save_state=save_state)
        for epoch in progress.epochs_left(args.epochs):
            if train_one_epoch(model, train_loader, optimizer=optimizer, scaler=scaler, loss_fn=loss_fn,
                               normalize=normalize, epoch=epoch, progress=progress, run=run):
                return utils.EXIT_STOPPED  # a stop request mid-epoch, checkpointed: run again to resume
            stopping = stop.check(device, progress.sums, scaler.is_enabled())  # all ranks agree; a NaN loss raises
            val = evaluate(eval_model, test_loader, normalize=normalize, device=device, amp_dtype=amp_dtype,
                           expected_count=len(test_data))
            metrics = utils.epoch_metrics(epoch, progress, val, optimizer.param_groups[0]["lr"])
            utils.log_epoch(metrics, args.epochs, n_finite=progress.sums[1])  # the original script's four lines
            progress.finish_epoch(metrics, args.patience, args.target_accuracy)  # early stopping decided here
            save_state()
            records.add_epoch(metrics)
            if progress.stopped_early:
                utils.log(f"Target accuracy reached. Early stopping after epoch {epoch}.")
                break
            if stopping and epoch < args.epochs:  # a stop request at the epoch's end
                utils.log(f"Stop requested ({stop.reason}) after epoch {epoch}: checkpoint saved; exiting with status "
                          f"{utils.EXIT_STOPPED} to be resumed.")
                return utils.EXIT_STOPPED
            if epoch == args.stop_after_epoch and epoch < args.epochs:
                utils.log(f"Stopping after epoch {epoch} as asked (--stop-after-epoch); run again to resume.")
                break
    records.finish(progress, len(train_data), len(test_data))  # summary.json and the original script's summary
    return 0


def evaluate_checkpoint(args, env, ckpt, path, amp_dtype) -> int:
    """--evaluate: score the checkpoint on its test set, with the model and data its config names."""
    device = env.device
    _, test_data = utils.call_and_agree(load_data, args, env, False)
    data = dataset_utils.DataSpec(**ckpt["config"]["data_spec"])  # the training set's, with its mean and std
    utils.call_and_agree(utils.check_same_data, ckpt, args, dataset_utils.image_shape(test_data),
                         {"test": dataset_utils.fingerprint(test_data)})
    utils.call_and_agree(utils.check_same_model, ckpt, path, model_config(args, data))
    eval_batch = min(-(-args.batch_size // env.world_size), args.micro_batch or args.batch_size)  # ceil: any world size
    test_loader = dataset_utils.build_test_loader(test_data, rank=env.rank, world_size=env.world_size,
                                                  batch_size=eval_batch, workers=0, pin_memory=device.type == "cuda",
                                                  device=dataset_utils.data_device(args.loader, device, test_data))
    model = utils.to_device(build_model(args, data), device)
    model.load_state_dict(ckpt["model"])
    model = torch.compile(model, dynamic=False) if args.compile else model
    epoch = ckpt["progress"]["epoch"]
    utils.log(f"Evaluating {path} ({utils.describe_model(ckpt['model_config'])}, {epoch} of {args.epochs} epochs "
              f"trained) on {len(test_data)} test images with {env.world_size} processes")
    normalize = dataset_utils.Normalize(data.mean, data.std, device, channels_last=device.type == "cuda")
    metrics = evaluate(model, test_loader, normalize=normalize, device=device, amp_dtype=amp_dtype,
                       expected_count=len(test_data))
    utils.record_evaluation(metrics, out_dir=args.out_dir, epoch=epoch, env=env, path=path)  # two lines, eval.json
    return 0


def main(args, explicit=frozenset()) -> int:
    """Set up the processes, the out-dir and the checkpoint, then train (or only evaluate); tear down whatever
    happens. A UserError ends every rank with exit status 2 and one line from rank 0 (from all if rendezvous failed)."""
    env, lock = utils.read_dist_env(), None
    try:
        env.device = utils.pick_device(args.device, env.local_rank)
        utils.init_distributed(env, args.timeout)  # NCCL on GPUs, gloo on CPU
        utils.check_args(args, env.world_size, env.device)  # after init, so that the ranks can wait for rank 0 to say why
        lock = None if args.evaluate else utils.lock_out_dir(args.out_dir, env)  # one run per out-dir; evaluation only reads
        ckpt, ckpt_path, notes = utils.find_checkpoint(args, explicit, env)
        amp_dtype = utils.resolve_amp(args.amp, env.device)
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels
        if args.evaluate:
            return evaluate_checkpoint(args, env, ckpt, ckpt_path, amp_dtype)
        return train(args, env, ckpt, ckpt_path, notes, amp_dtype, lock)
    except utils.UserError as e:
        return utils.leave_on_user_error(e)
    finally:
        if lock:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(utils.run_cli(main, get_args_parser()))  # parses the flags; Ctrl-C and dead peers said in a line
