"""Train a WideResNet on CIFAR-100 with DistributedDataParallel.

    python train_ddp.py --dataset synthetic --epochs 1                # one process (GPU or CPU)
    torchrun --standalone --nproc_per_node=4 train_ddp.py             # one node, 4 GPUs
    sbatch jobs/multigpu.sh                                           # Slurm

The same file runs under plain python and under torchrun: the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK) says whether this is one process of many. On CUDA each
process drives the GPU of its LOCAL_RANK with NCCL; without CUDA it runs on CPU with gloo.

The recipe reads top to bottom: main() sets up, loads the data, builds the model, resumes,
then for each epoch calls train_one_epoch() and evaluate(), records and checkpoints.
The places marked ADAPT are where you plug in your own data and model.
"""
import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dataset_utils
from model import WideResNet
from train_utils import (EXIT_STOPPED, OutDirLock, Progress, ProgressLog, StopRequest, UserError,
                         accumulation_steps, agree_on_error, all_gather, all_reduce_sum, broadcast_buffers,
                         catch_user_error, check_args, check_resumable, check_same_data, check_writable,
                         default_workers, describe_comm_failure, describe_model, explicit_flags, host_name,
                         init_distributed, load_latest_checkpoint, log, loss_stats, lr_factor, now_iso,
                         open_tensorboard, pick_device, read_dist_env, reconcile_with_checkpoint, resolve_amp,
                         run_record, save_checkpoint, scaled_lr, seed_everything, set_lr, unwrap, write_json,
                         write_text)

STOP_CHECK_EVERY = 10  # steps between the ranks' checks for a stop request or a non-finite loss


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="CIFAR-100 DDP example with Mixed Precision",
                                epilog="The defaults are the seed's 5-epoch smoke run; the full recipe (the WRN paper's "
                                       "WRN-16-8, 200 epochs) is RECIPE in jobs/lib.sh, which the job scripts run.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # The seed script's flags keep their meaning.
    p.add_argument("--batch-size", type=int, default=512, help="global batch size, split evenly over all ranks")
    p.add_argument("--epochs", type=int, default=5, help="number of epochs to train")
    p.add_argument("--base-lr", type=float, default=0.01, help="learning rate tuned for --reference-batch-size on one GPU")
    p.add_argument("--target-accuracy", type=float, default=0.85, help="validation accuracy (fraction) that counts towards early stopping")
    p.add_argument("--patience", type=int, default=2, help="stop after this many consecutive epochs at or above the target")
    # Model.
    p.add_argument("--depth", type=int, default=16, help="WideResNet depth, 6n+4")
    p.add_argument("--widen-factor", type=int, default=8, help="WideResNet width multiplier k")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout between the convs of each block")
    # Data.
    p.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100", help="synthetic: random data of CIFAR-100's shape, no download")
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


def build_model(args) -> nn.Module:
    # ADAPT: your model here. Record what defines its shape in model_config (below).
    return WideResNet(args.depth, args.widen_factor, dataset_utils.NUM_CLASSES, args.dropout)


def model_config(args) -> dict:
    return {"depth": args.depth, "widen_factor": args.widen_factor, "num_classes": dataset_utils.NUM_CLASSES}


def load_data(args, env, train: bool = True):
    """The (train, test) splits as ImageData (uint8 images, int64 labels); train is None if not asked for."""
    # ADAPT: your data here: two ImageData, or replace build_loaders too.
    if args.dataset == "cifar100":
        # One process per node prepares the data (the data dir may be node-local); the rest wait
        # in this collective, which also carries any error to every rank.
        err = catch_user_error(dataset_utils.prepare_cifar100, args.data_dir)[1] if env.local_rank == 0 else None
        agree_on_error(err)
    (splits, err) = catch_user_error(lambda: (
        dataset_utils.load_split(args.dataset, args.data_dir, True, args.train_size) if train else None,
        dataset_utils.load_split(args.dataset, args.data_dir, False, args.test_size)))
    agree_on_error(err)
    return splits


def train_step(model, images, labels, normalize, optimizer, scaler, loss_fn, amp_dtype, micro_sizes, step_samples):
    """One optimizer step on this rank's share of a global batch of `step_samples` samples, in
    micro-batches of `micro_sizes` (dataset_utils.micro_batch_sizes). `loss_fn` sums over its batch.
    Returns this step's loss sums (loss_stats), on the device: reading the loss on the host here
    would stall the GPU every step."""
    device = normalize.scale.device
    images = normalize(images.to(device, non_blocking=True))
    labels = labels.to(device, non_blocking=True)
    optimizer.zero_grad(set_to_none=True)
    # DDP averages the ranks' gradients, so each rank divides its sum by the step's samples per rank:
    # the update is then the mean over the whole global batch, even when the last step is uneven.
    per_rank = step_samples / (dist.get_world_size() if dist.is_initialized() else 1)
    stats, kept_buffers = 0, None
    for k, (x, y) in enumerate(zip(images.split(micro_sizes), labels.split(micro_sizes))):
        last = k == len(micro_sizes) - 1
        with nullcontext() if last else no_sync(model):  # DDP averages the gradients over all ranks once, in the last backward
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = loss_fn(model(x), y)  # an empty micro-batch gives 0 and leaves BN's statistics alone
            scaler.scale(loss / per_rank).backward()
        stats = stats + loss_stats(loss.detach(), y.numel())
        if len(micro_sizes) > 1 and k == 0:  # BN running stats as if micro-step k were rank r + k * world_size:
            kept_buffers = [b.detach().clone() for b in unwrap(model).buffers()]  # rank 0 keeps only k = 0's
    if kept_buffers is not None:
        for b, kept in zip(unwrap(model).buffers(), kept_buffers):
            b.copy_(kept)
    scaler.step(optimizer)  # with fp16, skipped when the gradients hold inf/NaN
    scaler.update()
    return stats


def no_sync(model):
    """DDP's no_sync (skip the gradient all-reduce) through torch.compile's wrapper; a no-op without DDP."""
    ddp = getattr(model, "_orig_mod", model)
    return ddp.no_sync() if isinstance(ddp, DDP) else nullcontext()


def train_one_epoch(model, loader, optimizer, scaler, loss_fn, normalize, amp_dtype, peak_lr, accum_steps,
                    epoch, progress, args, env, stop, progress_log, save_state, n_train) -> bool:
    """Train the rest of `epoch` from progress.position. Returns True if the ranks agreed to stop
    (a stop request), with a checkpoint saved. Raises UserError if the loss went non-finite."""
    model.train()
    loader_sampler = loader.batch_sampler
    loader_sampler.set_epoch(epoch, start=progress.position)  # a new order per epoch; after a resume, the rest
    # loss * n over finite losses, their n, and all n; a resumed epoch's sums so far sit on rank 0.
    sums = torch.tensor(progress.sums if env.is_main else [0.0] * 3, dtype=torch.float64, device=env.device)
    steps_per_epoch = progress.step + len(loader_sampler)
    t0 = time.perf_counter() - progress.elapsed_s
    for images, labels in loader:
        step_samples = min(args.batch_size, n_train - progress.position)  # the last step may be short
        done = progress.position + step_samples
        # The LR follows the samples seen, so a resume with another batch size keeps its schedule.
        set_lr(optimizer, peak_lr * lr_factor(epoch - 1 + progress.position / n_train, epoch - 1 + done / n_train,
                                              args.epochs, args.warmup_epochs, args.lr_schedule))
        micro_sizes = dataset_utils.micro_batch_sizes(step_samples, env.rank, env.world_size, accum_steps)
        sums += train_step(model, images, labels, normalize, optimizer, scaler, loss_fn, amp_dtype, micro_sizes,
                           step_samples)
        progress.position, progress.step = done, progress.step + 1
        if progress_log.due(progress.step):
            progress_log.show(epoch, progress.step, steps_per_epoch, done, sums[0].item() / max(sums[1].item(), 1),
                              time.perf_counter() - t0)
        checkpoint_due = args.checkpoint_every and progress.step % args.checkpoint_every == 0
        if progress.step % STOP_CHECK_EVERY == 0 or checkpoint_due:
            stopping = stop.check(env.device, sums, scaler.is_enabled())  # all ranks agree
            if stopping or checkpoint_due:
                progress.elapsed_s = time.perf_counter() - t0
                progress.sums = all_reduce_sum(sums.clone()).tolist()
                save_state()
            if stopping:
                log(f"Stop requested ({stop.signal or 'on another rank'}) in epoch {epoch} after step {progress.step}: "
                    f"checkpoint saved in {args.out_dir}; exiting with status {EXIT_STOPPED} to be resumed.")
                return True
    # Summing over ranks waits for the slowest, like the seed's barrier, so the time is honest.
    progress.sums = all_reduce_sum(sums).tolist()
    progress.elapsed_s = time.perf_counter() - t0
    progress_log.clear()
    return False


@torch.no_grad()
def evaluate(model, loader, normalize, device, amp_dtype, expected_count: int) -> dict:
    """Loss, top-1 and top-5 accuracy over the whole test set, exact for any world size.

    Each rank scores its own shard; the sums (not per-rank means) are all-reduced, so uneven
    shards weigh correctly. `model` is the bare model (not DDP, whose forward may broadcast and so
    would wait for a rank with nothing to score): every rank makes the same two collectives, the
    buffer broadcast and the all-reduce, even with an empty shard. The count check proves every
    test image was scored exactly once.
    """
    broadcast_buffers(model)
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss*n, top-1, top-5, n
    for images, labels in loader:
        images = normalize(images.to(device, non_blocking=True))
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
        top5 = logits.topk(min(5, logits.size(1)), dim=1).indices
        sums += torch.stack([loss.double(),
                             (top5[:, 0] == labels).sum().double(),
                             (top5 == labels[:, None]).any(dim=1).sum().double(),
                             torch.full((), labels.numel(), dtype=torch.float64, device=device)])  # no host copy
    all_reduce_sum(sums)
    loss_sum, top1, top5_correct, count = sums.tolist()
    if int(count) != expected_count:
        raise RuntimeError(f"evaluation scored {int(count)} images, but the test set has {expected_count}")
    return {"val_loss": loss_sum / count, "val_acc": top1 / count, "val_top5": top5_correct / count,
            "val_count": int(count)}


def main(args, explicit=frozenset()) -> int:
    env = read_dist_env()
    lock = None
    try:
        env.device = pick_device(args.device, env.local_rank)
        init_distributed(env, args.timeout)
        check_args(args, env.world_size, env.device)  # after init, so that the ranks can wait for rank 0 to say why
        if not args.evaluate:  # rank 0 owns the out-dir for the whole run; evaluation only reads it
            agree_on_error(catch_user_error(check_writable, args.out_dir)[1] if env.is_main else None)
            lock, err = catch_user_error(lambda: OutDirLock(args.out_dir).acquire()) if env.is_main else (None, None)
            agree_on_error(err)
        found, err = catch_user_error(load_latest_checkpoint, args.out_dir, env.device, args.keep_checkpoints)
        agree_on_error(err)
        ckpt, ckpt_path = found or (None, None)
        if args.evaluate and ckpt is None:
            raise UserError(f"--evaluate needs a checkpoint, and there is none in {args.out_dir}")
        notes, err = catch_user_error(reconcile_with_checkpoint, args, explicit, ckpt)
        agree_on_error(err)
        agree_on_error(check_resumable(ckpt, ckpt_path, model_config(args), env.device, args.evaluate))
        amp_dtype = resolve_amp(args.amp, env.device)
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels
        if args.evaluate:
            return evaluate_checkpoint(args, env, ckpt, ckpt_path, amp_dtype)
        if lock and lock.note:
            log(f"note: {lock.note}")
        return train(args, env, ckpt, ckpt_path, notes, amp_dtype, lock)
    except UserError as e:
        log(f"error: {e}", file=sys.stderr)
        # torchrun kills the other ranks as soon as one exits: leave only once rank 0 has said why.
        if dist.is_initialized():
            dist.barrier()
        elif env.rank != 0:
            time.sleep(5)
        return 2
    finally:
        if lock:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args, env, ckpt, ckpt_path, notes, amp_dtype, lock) -> int:
    device = env.device
    # ------------------------------------------------------------------ setup
    ranks = all_gather({"rank": env.rank, "local_rank": env.local_rank, "host": host_name(),
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})
    hosts = [r["host"] for r in ranks]
    nodes = len(set(hosts))
    unit = "GPUs" if device.type == "cuda" else "CPU processes"
    per_rank_batch = args.batch_size // env.world_size
    accum_steps = accumulation_steps(per_rank_batch, args.micro_batch)
    micro_batch = per_rank_batch // accum_steps
    lr = scaled_lr(args.base_lr, args.batch_size, args.reference_batch_size, args.lr_scaling)
    workers = args.workers if args.workers >= 0 else default_workers(env)
    config = {**vars(args), "world_size": env.world_size, "nodes": nodes, "per_rank_batch": per_rank_batch,
              "accumulation_steps": accum_steps, "micro_batch_size": micro_batch, "lr": lr, "num_workers": workers,
              "device_type": device.type, "amp_dtype": str(amp_dtype)}
    log(f"Training started with {env.world_size} processes across {nodes} nodes.")
    log(f"Using {env.local_world_size} {unit} per node.")
    log("Config: " + json.dumps(config))
    split = (f"{env.world_size} ranks x {accum_steps} accumulation steps x {micro_batch}" if accum_steps > 1
             else f"{env.world_size} ranks x {per_rank_batch}")
    log(f"Global batch {args.batch_size} = {split}; "
        f"LR {lr:.4g} ({args.lr_scaling} scaling of {args.base_lr:g} from batch {args.reference_batch_size})")
    for note in notes:
        log(f"note: {note}")

    # ------------------------------------------------------------------ data
    train_data, test_data = load_data(args, env)
    fingerprints = {"train": dataset_utils.fingerprint(train_data), "test": dataset_utils.fingerprint(test_data)}
    agree_on_error(check_same_data(ckpt, fingerprints, args))
    on_device = args.loader == "gpu" or (args.loader == "auto" and device.type == "cuda")
    train_loader, test_loader = dataset_utils.build_loaders(
        train_data, test_data, args.batch_size, env.rank, env.world_size, accum_steps, micro_batch, args.seed,
        workers, pin_memory=device.type == "cuda", device=device if on_device else None)
    channels_last = device.type == "cuda"  # what cuDNN's fastest convolutions want
    normalize = dataset_utils.Normalize(dataset_utils.CIFAR100_MEAN, dataset_utils.CIFAR100_STD, device, channels_last)
    n_train, n_test = len(train_data.labels), len(test_data.labels)

    # ------------------------------------------------------------------ model and optimiser
    seed_everything(args.seed)  # the same initial weights on every rank
    model = build_model(args)
    if args.sync_bn:  # before DDP, so that DDP all-reduces the statistics within each forward
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=args.nesterov,
                                weight_decay=args.weight_decay, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bf16 needs none
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing, reduction="sum")  # train_step averages
    seed_everything(args.seed + env.rank)  # dropout then differs across ranks, as it should

    # ------------------------------------------------------------------ resume
    progress = Progress()
    if ckpt is not None:
        progress = restore_checkpoint(ckpt, ckpt_path, model, optimizer, scaler, args, env, lr, config)
    bare_model = model
    if env.distributed:  # gradient_as_bucket_view: gradients live in the all-reduce buckets, no copy
        model = DDP(model, device_ids=[env.local_rank] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    eval_model = bare_model  # evaluate() needs no DDP (see there)
    if args.compile:  # a static graph per shape (the last batch is smaller)
        model = torch.compile(model, dynamic=False)
        eval_model = torch.compile(bare_model, dynamic=False)

    def save_state():
        """Every rank calls this (it gathers their RNG states); rank 0 writes."""
        rng_cpu = all_gather(torch.get_rng_state())
        rng_cuda = all_gather(torch.cuda.get_rng_state(device)) if device.type == "cuda" else []
        if env.is_main:
            lock.check()  # never write over another run's checkpoint
            save_checkpoint(args.out_dir, {
                "model": bare_model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                "progress": asdict(progress), "config": config, "model_config": model_config(args),
                "data": fingerprints, "world_size": env.world_size, "rng_cpu": rng_cpu, "rng_cuda": rng_cuda},
                args.keep_checkpoints)

    # ------------------------------------------------------------------ training loop
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    if env.is_main:
        write_json(os.path.join(args.out_dir, "config.json"), config)
        # Keep the metrics of the epochs the checkpoint holds; later ones will be trained again.
        lines = open(metrics_path).readlines() if os.path.exists(metrics_path) else []
        write_text(metrics_path, "".join(ln for ln in lines if json.loads(ln)["epoch"] <= progress.epoch))
    record = run_record(config, ranks)
    if env.is_main:
        write_json(os.path.join(args.out_dir, "run.json"), record)
    stop, progress_log = StopRequest(), ProgressLog(args.log_every)
    tensorboard = open_tensorboard(args.out_dir) if args.tensorboard and env.is_main else None
    for epoch in range(progress.epoch + 1, args.epochs + 1):
        if progress.stopped_early:
            break
        if train_one_epoch(model, train_loader, optimizer, scaler, loss_fn, normalize, amp_dtype, lr, accum_steps,
                           epoch, progress, args, env, stop, progress_log, save_state, n_train):
            return EXIT_STOPPED
        loss_sum, n_finite, count = progress.sums
        epoch_time = progress.elapsed_s
        stopping = stop.check(device, torch.tensor(progress.sums, dtype=torch.float64, device=device),
                              scaler.is_enabled())
        metrics = {"epoch": epoch, "train_loss": loss_sum / max(n_finite, 1), "train_samples": int(count),
                   **evaluate(eval_model, test_loader, normalize, device, amp_dtype, n_test),
                   "lr": optimizer.param_groups[0]["lr"], "epoch_time_s": epoch_time,
                   "images_per_s": count / epoch_time}
        log(f"Epoch {epoch}/{args.epochs} completed in {epoch_time:.3f} seconds")
        log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
        log(f"Epoch Throughput: {metrics['images_per_s']:.3f} images/second")
        log(f"Train Loss: {metrics['train_loss']:.4f}, Validation Top-5 Accuracy: {metrics['val_top5']:.4f}")
        if n_finite < count:
            log(f"warning: {int(count - n_finite)} samples had a non-finite fp16 loss; the scaler skipped their steps")

        # Every rank sees the same all-reduced accuracy, so all of them stop at the same epoch.
        progress.history.append(metrics)
        recent = [m["val_acc"] for m in progress.history[-args.patience:]]
        progress.stopped_early = len(recent) == args.patience and min(recent) >= args.target_accuracy
        progress.epoch, progress.position, progress.step = epoch, 0, 0
        progress.sums, progress.elapsed_s = [0.0] * 3, 0.0
        progress.total_time_s += epoch_time
        progress.total_images += int(count)
        save_state()
        if env.is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            for key, value in metrics.items() if tensorboard else ():
                tensorboard.add_scalar(key, value, epoch)
            if tensorboard:
                tensorboard.flush()  # a preempted run keeps its curves too
        if progress.stopped_early:
            log(f"Target accuracy reached. Early stopping after epoch {epoch}.")
        elif stopping and epoch < args.epochs:
            log(f"Stop requested ({stop.signal or 'on another rank'}) after epoch {epoch}: checkpoint saved; "
                f"exiting with status {EXIT_STOPPED} to be resumed.")
            return EXIT_STOPPED
        elif epoch == args.stop_after_epoch and epoch < args.epochs:
            log(f"Stopping after epoch {epoch} as asked (--stop-after-epoch); run again to resume.")
            break

    # ------------------------------------------------------------------ summary
    history = progress.history
    summary = {
        "total_time_s": progress.total_time_s, "world_size": env.world_size, "nodes": nodes,
        "images_per_s": progress.total_images / progress.total_time_s if progress.total_time_s else 0.0,
        "gpus_per_node": env.local_world_size, "device": device.type, "hosts": sorted(set(hosts)),
        "epochs_completed": progress.epoch, "finished": progress.stopped_early or progress.epoch >= args.epochs,
        "stopped_early": progress.stopped_early, "best_val_acc": max((m["val_acc"] for m in history), default=0.0),
        "final_val_acc": history[-1]["val_acc"] if history else 0.0, "n_train": n_train, "n_test": n_test,
        "config": config,
    }
    if env.is_main:
        write_json(os.path.join(args.out_dir, "summary.json"), summary)
        write_json(os.path.join(args.out_dir, "run.json"), {**record, "end_time": now_iso()})
        if tensorboard:
            tensorboard.close()
    log("\nTraining Summary:")
    log(f"Total training time: {progress.total_time_s:.3f} seconds")
    log(f"Throughput: {summary['images_per_s']:.3f} images/second")
    log(f"Number of nodes: {nodes}")
    log(f"Number of GPUs per node: {env.local_world_size}")
    log(f"Total GPUs used: {env.world_size}")
    log("Training completed successfully." if summary["finished"] else
        f"Training paused after epoch {progress.epoch} of {args.epochs}; run again to resume.")
    return 0


def restore_checkpoint(ckpt, path, model, optimizer, scaler, args, env, lr, config) -> Progress:
    """Load the checkpoint's state into this run's objects; say what changed. Returns its Progress."""
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt["scaler"]:  # empty unless that run used fp16
        scaler.load_state_dict(ckpt["scaler"])
    saved = ckpt["config"]
    state = dict(ckpt["progress"])
    state.setdefault("position", state.get("step", 0) * saved["batch_size"])  # checkpoints that counted steps
    progress = Progress(**state)
    if saved["lr"] != lr:
        log(f"note: the peak LR changed from {saved['lr']:.4g} to {lr:.4g} on resume")
    if saved["batch_size"] != args.batch_size:
        log(f"note: the global batch changed from {saved['batch_size']} to {args.batch_size} on resume: the "
            f"schedule keeps its place in samples (epoch {progress.epoch + 1} resumes at sample "
            f"{progress.position})")
    if (saved.get("accumulation_steps", 1), saved.get("micro_batch_size")) != (
            config["accumulation_steps"], config["micro_batch_size"]) and saved["world_size"] != env.world_size:
        log(f"note: {saved['world_size']} ranks x {saved.get('accumulation_steps', 1)} accumulation steps x "
            f"{saved.get('micro_batch_size', saved['per_rank_batch'])} before, {env.world_size} x "
            f"{config['accumulation_steps']} x {config['micro_batch_size']} now: the same global batch")
    progress.step = -(-progress.position // args.batch_size)
    if ckpt["world_size"] == env.world_size:  # else the seed above serves as well as any
        torch.set_rng_state(ckpt["rng_cpu"][env.rank].cpu())
        if env.device.type == "cuda" and ckpt["rng_cuda"]:
            torch.cuda.set_rng_state(ckpt["rng_cuda"][env.rank].cpu(), env.device)
    log(f"Resumed from {path}: epoch {progress.epoch} of {args.epochs} done"
        + (f", and {progress.position} samples ({progress.step} steps) of the next." if progress.position else "."))
    return progress


def evaluate_checkpoint(args, env, ckpt, path, amp_dtype) -> int:
    """--evaluate: score the checkpoint on its test set, with the model and data its config names."""
    device = env.device
    _, test_data = load_data(args, env, train=False)
    agree_on_error(check_same_data(ckpt, {"test": dataset_utils.fingerprint(test_data)}, args))
    eval_batch = min(-(-args.batch_size // env.world_size), args.micro_batch or args.batch_size)
    on_device = args.loader == "gpu" or (args.loader == "auto" and device.type == "cuda")
    test_loader = dataset_utils.build_test_loader(test_data, env.rank, env.world_size, eval_batch,
                                                  workers=0, pin_memory=device.type == "cuda",
                                                  device=device if on_device else None)
    channels_last = device.type == "cuda"
    model = build_model(args)
    model.load_state_dict(ckpt["model"])
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    if args.compile:
        model = torch.compile(model, dynamic=False)
    normalize = dataset_utils.Normalize(dataset_utils.CIFAR100_MEAN, dataset_utils.CIFAR100_STD, device, channels_last)
    epoch = ckpt["progress"]["epoch"]
    log(f"Evaluating {path} ({describe_model(ckpt['model_config'])}, {epoch} of {args.epochs} epochs trained) "
        f"on {len(test_data.labels)} test images with {env.world_size} processes")
    metrics = evaluate(model, test_loader, normalize, device, amp_dtype, len(test_data.labels))
    log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
    log(f"Validation Top-5 Accuracy: {metrics['val_top5']:.4f} on {metrics['val_count']} images")
    if env.is_main:
        write_json(os.path.join(args.out_dir, "eval.json"), {**metrics, "epoch": epoch, "world_size": env.world_size,
                                                             "checkpoint": path})
    return 0


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 <pid>`: where is it stuck?
    parser = get_args_parser()
    args = parser.parse_args()
    try:
        sys.exit(main(args, explicit_flags(parser, sys.argv[1:])))
    except KeyboardInterrupt:  # Ctrl-C before the training loop, which turns it into a checkpointed stop
        print(f"rank {os.environ.get('RANK', 0)}: interrupted before training started; nothing to save",
              file=sys.stderr, flush=True)
        sys.exit(130)
    except RuntimeError as e:  # a hung or dead peer: say so on every rank, not after a wall of C++ frames
        if (why := describe_comm_failure(e, args.timeout)) is None:
            raise
        print(f"error: rank {os.environ.get('RANK', 0)}: {why}", file=sys.stderr, flush=True)
        sys.exit(1)
