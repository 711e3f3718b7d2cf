"""Train a WideResNet on CIFAR-100 with DistributedDataParallel.

    python train_ddp.py --dataset synthetic --epochs 1                # one process (GPU or CPU)
    torchrun --standalone --nproc_per_node=4 train_ddp.py             # one node, 4 GPUs
    sbatch jobs/multigpu.sh                                           # Slurm

The same file runs under plain python and under torchrun: the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK) says whether this is one process of many. On CUDA each
process drives the GPU of its LOCAL_RANK with NCCL; without CUDA it runs on CPU with gloo.

The recipe reads top to bottom: setup, data, model, resume, training loop, summary.
The places marked ADAPT are where you plug in your own data and model.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dataset_utils
from model import WideResNet, check_depth
from train_utils import (UserError, agree_on_error, all_gather, all_reduce_sum, catch_user_error,
                         check_writable, describe_model, evaluate, host_name, init_distributed,
                         load_checkpoint, log, lr_lambda, pick_device, read_dist_env, save_checkpoint,
                         scaled_lr, seed_everything, unwrap, write_json, write_text)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="CIFAR-100 DDP example with Mixed Precision",
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
    p.add_argument("--workers", type=int, default=-1, help="DataLoader workers per rank (-1: the rank's share of the CPUs, at most 8)")
    # Optimisation.
    p.add_argument("--reference-batch-size", type=int, default=512, help="the batch size --base-lr was tuned for")
    p.add_argument("--lr-scaling", choices=["linear", "sqrt", "none"], default="linear", help="how the LR grows with batch-size / reference-batch-size")
    p.add_argument("--lr-schedule", choices=["cosine", "step"], default="cosine", help="after warm-up: cosine to 0, or the WRN paper's x0.2 steps at 30/60/80%%")
    p.add_argument("--warmup-epochs", type=float, default=1.0, help="linear LR warm-up from ~0, in epochs")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=False, help="Nesterov momentum")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="label smoothing of the training loss")
    # Run.
    p.add_argument("--out-dir", default="./runs/wrn", help="checkpoint, metrics and summary go here; a checkpoint here is resumed")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights, the data order and augmentation")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA if available, else CPU")
    p.add_argument("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto", help="mixed precision; auto: bf16 where supported, fp16 on older GPUs, off on CPU")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a hung collective or rendezvous fails")
    p.add_argument("--stop-after-epoch", type=int, default=0, help="end this run after that epoch, checkpointed, to resume in a later job (0: never)")
    p.add_argument("--evaluate", action="store_true", help="evaluate the checkpoint in --out-dir on the test set and exit")
    return p


def check_args(args, world_size: int) -> None:
    """Reject bad input before any work, with one line that says what to change."""
    if args.batch_size < 1 or args.batch_size % world_size:
        raise UserError(f"--batch-size {args.batch_size} must be a positive multiple of the world size "
                        f"{world_size}; try --batch-size {max(1, round(args.batch_size / world_size)) * world_size}")
    try:
        check_depth(args.depth)
    except ValueError as e:
        raise UserError(f"--depth: {e}") from None
    if args.epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {args.epochs}")
    if not 0.0 <= args.target_accuracy <= 1.0:
        raise UserError(f"--target-accuracy is a fraction in [0, 1], got {args.target_accuracy} (85% is 0.85)")
    for name in ("patience", "widen_factor", "reference_batch_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("train_size", "test_size", "warmup_epochs", "weight_decay", "stop_after_epoch"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if not (0.0 <= args.dropout < 1.0 and 0.0 <= args.label_smoothing < 1.0 and args.base_lr > 0):
        raise UserError("--dropout and --label-smoothing must lie in [0, 1), and --base-lr must be positive")


def resolve_amp(amp: str, device: torch.device):
    """The autocast dtype, or None for full fp32."""
    if amp == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[amp]


def build_model(args) -> nn.Module:
    # ADAPT: your model here. Record what defines its shape in model_config (below).
    return WideResNet(args.depth, args.widen_factor, dataset_utils.NUM_CLASSES, args.dropout)


def train_one_epoch(model, loader, normalize, optimizer, scheduler, scaler, loss_fn, device, amp_dtype):
    """One pass over this rank's shard. Returns (sum of per-sample losses, samples) as device
    tensors: the loss is never read on the host mid-epoch, which would stall the GPU every step."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for images, labels in loader:
        images = normalize(images.to(device, non_blocking=True))
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) the gradients during backward
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        loss_sum += loss.detach().double() * labels.numel()
        count += labels.numel()
    return loss_sum, count


def main(args) -> None:
    env = read_dist_env()
    check_args(args, env.world_size)
    env.device = pick_device(args.device, env.local_rank)
    amp_dtype = resolve_amp(args.amp, env.device)
    init_distributed(env, args.timeout)
    try:
        run(args, env, amp_dtype)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args, env, amp_dtype) -> None:
    device = env.device
    # ------------------------------------------------------------------ setup
    hosts = all_gather(host_name())
    nodes = len(set(hosts))
    unit = "GPUs" if device.type == "cuda" else "CPU processes"
    per_rank_batch = args.batch_size // env.world_size
    lr = scaled_lr(args.base_lr, args.batch_size, args.reference_batch_size, args.lr_scaling)
    workers = args.workers if args.workers >= 0 else min(8, len(os.sched_getaffinity(0)) // env.local_world_size)
    agree_on_error(catch_user_error(check_writable, args.out_dir)[1] if env.is_main else None)
    config = {**vars(args), "world_size": env.world_size, "nodes": nodes, "per_rank_batch": per_rank_batch,
              "lr": lr, "num_workers": workers, "device_type": device.type, "amp_dtype": str(amp_dtype)}
    log(f"Training started with {env.world_size} processes across {nodes} nodes.")
    log(f"Using {env.local_world_size} {unit} per node.")
    log("Config: " + json.dumps(config))
    log(f"Global batch {args.batch_size} = {env.world_size} ranks x {per_rank_batch}; "
        f"LR {lr:.4g} ({args.lr_scaling} scaling of {args.base_lr:g} from batch {args.reference_batch_size})")

    # ------------------------------------------------------------------ data
    # ADAPT: your data here: two ImageData (uint8 images, int64 labels), or replace build_loaders.
    if args.dataset == "cifar100":
        # One process per node prepares the data (the data dir may be node-local); the rest wait
        # in this collective, which also carries any error to every rank.
        err = catch_user_error(dataset_utils.prepare_cifar100, args.data_dir)[1] if env.local_rank == 0 else None
        agree_on_error(err)
    (train_data, test_data), err = catch_user_error(lambda: (
        dataset_utils.load_split(args.dataset, args.data_dir, True, args.train_size),
        dataset_utils.load_split(args.dataset, args.data_dir, False, args.test_size)))
    agree_on_error(err)
    train_loader, test_loader = dataset_utils.build_loaders(
        train_data, test_data, per_rank_batch, env.rank, env.world_size, args.seed, workers,
        pin_memory=device.type == "cuda")
    normalize = dataset_utils.Normalize(dataset_utils.CIFAR100_MEAN, dataset_utils.CIFAR100_STD, device)
    n_train, n_test = len(train_data.labels), len(test_data.labels)

    # ------------------------------------------------------------------ model and optimiser
    seed_everything(args.seed)  # the same initial weights on every rank
    model = build_model(args).to(device)
    model_config = {"depth": args.depth, "widen_factor": args.widen_factor, "num_classes": dataset_utils.NUM_CLASSES}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, nesterov=args.nesterov,
                                weight_decay=args.weight_decay)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(steps_per_epoch, args.epochs, args.warmup_epochs, args.lr_schedule))
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # bf16 needs none
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    seed_everything(args.seed + env.rank)  # dropout then differs across ranks, as it should

    # ------------------------------------------------------------------ resume
    ckpt_path = os.path.join(args.out_dir, "checkpoint.pt")
    start_epoch, history, total_time, total_images, stopped_early = 0, [], 0.0, 0, False
    if os.path.exists(ckpt_path):
        ckpt, err = catch_user_error(load_checkpoint, ckpt_path, device)
        if ckpt is not None and ckpt["model_config"] != model_config:
            err = (f"{ckpt_path} holds {describe_model(ckpt['model_config'])}, but this run builds "
                   f"{describe_model(model_config)}; pass the same --depth/--widen-factor, or another --out-dir")
        agree_on_error(err)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, history, stopped_early = ckpt["epoch"], ckpt["val_history"], ckpt["stopped_early"]
        total_time, total_images = ckpt["total_time_s"], ckpt["total_images"]
        if ckpt["world_size"] == env.world_size:  # else: the seed above is as good as any
            torch.set_rng_state(ckpt["rng_cpu"][env.rank].cpu())
            if device.type == "cuda":
                torch.cuda.set_rng_state(ckpt["rng_cuda"][env.rank].cpu(), device)
        log(f"Resumed from {ckpt_path}: {start_epoch} of {args.epochs} epochs done.")
    elif args.evaluate:
        raise UserError(f"--evaluate needs a checkpoint, and {ckpt_path} does not exist")
    if env.distributed:
        model = DDP(model, device_ids=[env.local_rank] if device.type == "cuda" else None)

    if args.evaluate:
        metrics = evaluate(model, test_loader, normalize, device, amp_dtype, n_test)
        log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
        log(f"Validation Top-5 Accuracy: {metrics['val_top5']:.4f} on {metrics['val_count']} images")
        if env.is_main:
            write_json(os.path.join(args.out_dir, "eval.json"), {**metrics, "epoch": start_epoch,
                                                                 "world_size": env.world_size})
        return

    # ------------------------------------------------------------------ training loop
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    if env.is_main:
        write_json(os.path.join(args.out_dir, "config.json"), config)
        # Keep the metrics of the epochs the checkpoint holds; later ones will be trained again.
        lines = open(metrics_path).readlines() if os.path.exists(metrics_path) else []
        write_text(metrics_path, "".join(l for l in lines if json.loads(l)["epoch"] <= start_epoch))
    metrics = history[-1] if history else {}
    epoch = start_epoch
    for epoch in range(start_epoch + 1, args.epochs + 1):
        if stopped_early:
            break
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        t0 = time.perf_counter()
        loss_sum, count = train_one_epoch(model, train_loader, normalize, optimizer, scheduler, scaler,
                                          loss_fn, device, amp_dtype)
        # Summing over ranks waits for the slowest, like the seed's barrier, so the time is honest.
        loss_sum, count = all_reduce_sum(torch.stack([loss_sum, count])).tolist()
        epoch_time = time.perf_counter() - t0
        total_time += epoch_time
        total_images += int(count)
        metrics = {"epoch": epoch, "train_loss": loss_sum / count,
                   **evaluate(model, test_loader, normalize, device, amp_dtype, n_test),
                   "lr": scheduler.get_last_lr()[0], "epoch_time_s": epoch_time, "images_per_s": count / epoch_time}
        log(f"Epoch {epoch}/{args.epochs} completed in {epoch_time:.3f} seconds")
        log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
        log(f"Epoch Throughput: {metrics['images_per_s']:.3f} images/second")
        log(f"Train Loss: {metrics['train_loss']:.4f}, Validation Top-5 Accuracy: {metrics['val_top5']:.4f}")

        # Every rank sees the same all-reduced accuracy, so all of them stop at the same epoch.
        history.append(metrics)
        recent = [m["val_acc"] for m in history[-args.patience:]]
        stopped_early = len(recent) == args.patience and min(recent) >= args.target_accuracy
        rng_cpu = all_gather(torch.get_rng_state())
        rng_cuda = all_gather(torch.cuda.get_rng_state(device)) if device.type == "cuda" else []
        if env.is_main:
            save_checkpoint(ckpt_path, {
                "model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "epoch": epoch, "val_history": history, "stopped_early": stopped_early,
                "total_time_s": total_time, "total_images": total_images,
                "config": config, "model_config": model_config, "world_size": env.world_size,
                "rng_cpu": rng_cpu, "rng_cuda": rng_cuda})
            with open(metrics_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if stopped_early:
            log(f"Target accuracy reached. Early stopping after epoch {epoch}.")
        elif epoch == args.stop_after_epoch and epoch < args.epochs:
            log(f"Stopping after epoch {epoch} as asked (--stop-after-epoch); run again to resume.")
            break

    # ------------------------------------------------------------------ summary
    epochs_done = history[-1]["epoch"] if history else 0
    summary = {
        "total_time_s": total_time, "images_per_s": total_images / total_time if total_time else 0.0,
        "world_size": env.world_size, "nodes": nodes, "gpus_per_node": env.local_world_size,
        "device": device.type, "hosts": sorted(set(hosts)), "epochs_completed": epochs_done,
        "finished": stopped_early or epochs_done >= args.epochs, "stopped_early": stopped_early,
        "best_val_acc": max((m["val_acc"] for m in history), default=0.0),
        "final_val_acc": metrics.get("val_acc", 0.0), "n_train": n_train, "n_test": n_test,
        "config": config,
    }
    if env.is_main:
        write_json(os.path.join(args.out_dir, "summary.json"), summary)
    log("\nTraining Summary:")
    log(f"Total training time: {total_time:.3f} seconds")
    log(f"Throughput: {summary['images_per_s']:.3f} images/second")
    log(f"Number of nodes: {nodes}")
    log(f"Number of GPUs per node: {env.local_world_size}")
    log(f"Total GPUs used: {env.world_size}")
    log("Training completed successfully." if summary["finished"] else
        f"Training paused after epoch {epochs_done} of {args.epochs}; run again to resume.")


if __name__ == "__main__":
    try:
        main(get_args_parser().parse_args())
    except UserError as e:
        log(f"error: {e}", file=sys.stderr)
        sys.exit(2)
