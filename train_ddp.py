"""Train a WideResNet on CIFAR-100 with DistributedDataParallel.

    python train_ddp.py --recipe cpu-try                              # one process, about a minute on a CPU
    torchrun --standalone --nproc_per_node=4 train_ddp.py             # one node, 4 GPUs
    sbatch jobs/multigpu.sh                                           # Slurm: --recipe wrn-paper

The same file runs under plain python and under torchrun: the launcher's environment (RANK, LOCAL_RANK,
WORLD_SIZE) says whether this is one process of many. On CUDA each process drives the GPU of its LOCAL_RANK
with NCCL; without CUDA it runs on CPU with gloo. Read it top to bottom: the flags and the named recipes;
the two places marked ADAPT, where your model and data go (the data describe themselves: channels, size,
classes, mean and std, and the model, the normalisation and the augmentation follow); then the DDP story:
train_step, train_one_epoch, evaluate, and train(), which sets the run up, wraps the model in DDP and loops
over the epochs. For a task other than classification, also change loss_fn and the metrics in evaluate().
"""
import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dataset_utils
import train_utils as utils
from model import WideResNet, depth_arg, width_arg

# Named presets for --recipe: flag -> value, under any flag given on the command line. With no
# --recipe the defaults are the original script's 5-epoch smoke run.
RECIPES = {
    # The WRN paper's WRN-16-8 for CIFAR-100 (Zagoruyko & Komodakis 2016: 79.6% top-1): Nesterov SGD 0.9, LR 0.1 per
    # 128 samples, weight decay 5e-4, 200 epochs, x0.2 at 60/120/160; at batch 512 by the linear rule, 5 warm-up epochs.
    "wrn-paper": dict(depth=16, widen_factor=8, dropout=0.0, epochs=200, batch_size=512, base_lr=0.1,
                      reference_batch_size=128, lr_scaling="linear", warmup_epochs=5.0, lr_schedule="step",
                      momentum=0.9, nesterov=True, weight_decay=5e-4),
    # The original script's LR: --base-lr as given for any batch, constant, no warm-up. With its job's flags
    # (--batch-size 1024 --epochs 100 --base-lr 0.04 --target-accuracy 0.95 --patience 2) it trains at 0.04.
    "original": dict(lr_scaling="none", warmup_epochs=0.0, lr_schedule="constant"),
    # About a minute on a CPU: a WRN-10-2 on the learnable synthetic data, no download (13% -> 89% top-1).
    "cpu-try": dict(dataset="synthetic", depth=10, widen_factor=2, train_size=5000, test_size=1000,
                    batch_size=128, base_lr=0.1, reference_batch_size=128, epochs=3, out_dir="runs/cpu-try"),
}


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="CIFAR-100 DDP example with Mixed Precision",
                                epilog="The defaults are the original script's 5-epoch smoke run.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument_group("the original script's flags").add_argument  # their meaning kept
    add("--batch-size", type=int, default=512, help="global batch size, split evenly over all ranks")
    add("--epochs", type=int, default=5, help="number of epochs to train")
    add("--base-lr", type=float, default=0.01, help="LR for a global batch of --reference-batch-size")
    add("--target-accuracy", type=float, default=0.85, help="validation accuracy (fraction) for early stopping")
    add("--patience", type=int, default=2, help="stop after this many epochs in a row at or above the target")
    add = p.add_argument_group("model").add_argument
    add("--depth", type=depth_arg, default=16, help="WideResNet depth, 6n+4")
    add("--widen-factor", type=width_arg, default=8, help="WideResNet width multiplier k")
    add("--dropout", type=float, default=0.0, help="dropout between the convs of each block")
    add = p.add_argument_group("data").add_argument
    add("--dataset", choices=["cifar100", "synthetic"], default="cifar100", help="synthetic: learnable, no download")
    add("--data-dir", default="./datasets", help="where cifar-100-python.tar.gz is, or is downloaded to")
    add("--train-size", type=int, default=0, help="use only the first N training samples (0: all)")
    add("--test-size", type=int, default=0, help="use only the first N test samples (0: all)")
    add("--loader", choices=["auto", "gpu", "torch"], default="auto", help="gpu: data kept on the device (the CPU "
        "without CUDA); torch: DataLoader workers; auto: gpu on CUDA, else torch")
    add("--workers", type=int, default=-1, help="DataLoader workers per rank (-1: its share of the CPUs, at most 8)")
    add("--skip-bad-samples", type=int, default=0, help="skip up to N unreadable training samples per epoch (0: stop)")
    add = p.add_argument_group("optimisation and schedule").add_argument
    add("--micro-batch", type=int, default=None, help="most samples per forward on a rank, more by accumulation")
    add("--reference-batch-size", type=int, default=512, help="the global batch --base-lr was tuned for")
    add("--lr-scaling", choices=["linear", "sqrt", "none"], default="linear", help="LR rule for the batch's ratio")
    add("--lr-schedule", choices=["cosine", "step", "constant"], default="cosine", help="after warm-up: cosine to 0, "
        "x0.2 steps at 30/60/80%%, or constant")
    add("--warmup-epochs", type=float, default=1.0, help="linear LR warm-up from ~0, in epochs")
    add("--momentum", type=float, default=0.9, help="SGD momentum")
    add("--nesterov", action=argparse.BooleanOptionalAction, default=False, help="Nesterov momentum")
    add("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    add("--label-smoothing", type=float, default=0.0, help="label smoothing of the training loss")
    add("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks (SyncBatchNorm; CUDA only)")
    add("--find-unused-parameters", action="store_true", help="let the loss leave parameters out (DDP: cost per step)")
    add = p.add_argument_group("the run").add_argument
    add("--recipe", choices=sorted(RECIPES), default=None, help="a named preset (below); flags given win over it")
    add("--out-dir", default="./runs/wrn", help="checkpoints, metrics and summary; a checkpoint here is resumed")
    add("--seed", type=int, default=0, help="seed for the weights, the data order and augmentation")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA if available, else CPU")
    add("--amp", choices=["auto", "fp16", "bf16", "off"], default="auto", help="mixed precision; auto: bf16 on GPUs")
    add("--timeout", type=float, default=600, help="seconds before a hung collective or rendezvous fails")
    add("--log-every", type=int, default=50, help="a progress line every N steps (0: none)")
    add("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: at epoch ends only)")
    add("--keep-checkpoints", type=int, default=2, help="how many recent checkpoints to keep")
    add("--stop-after-epoch", type=int, default=0, help="end this run after that epoch, to resume later (0: never)")
    add("--evaluate", action="store_true", help="score the checkpoint in --out-dir on its test set, and exit")
    add("--compile", action="store_true", help="torch.compile the model (slower start, faster steps)")
    add("--tensorboard", action="store_true", help="also log the epoch metrics to out-dir/tensorboard")
    add("--profile", action="store_true", help="trace steps 4-8 of the first epoch on each rank into out-dir/profile")
    return p


def build_model(cfg, data) -> nn.Module:
    # ADAPT (1/2): your model here, taking its input channels and classes from `data` (a DataSpec); in model_config
    # what fixes its shapes (a checkpoint must match them; "name" is what messages call it).
    return WideResNet(cfg.depth, cfg.widen_factor, num_classes=data.num_classes, dropout=cfg.dropout,
                      in_channels=data.channels)


def model_config(cfg, data) -> dict:
    return {"name": f"WRN-{cfg.depth}-{cfg.widen_factor}", "depth": cfg.depth, "widen_factor": cfg.widen_factor,
            "in_channels": data.channels, "num_classes": data.num_classes}


def load_data(cfg, env, train: bool = True):
    """The (train, test) splits: dataset_utils.ImageData (uint8 images N x C x H x W, int64 labels) for data
    that fit in memory, or Datasets of (uint8 C x H x W tensor, label) for --loader torch. train: None if
    not asked for. The rest follows from what this returns: see dataset_utils.measure_data."""
    # ADAPT (2/2): your data here.
    if cfg.dataset == "cifar100":
        dataset_utils.prepare_cifar100(cfg.data_dir, env)  # one process per node downloads and checks it
    return (dataset_utils.load_split(cfg.dataset, cfg.data_dir, True, cfg.train_size) if train else None,
            dataset_utils.load_split(cfg.dataset, cfg.data_dir, False, cfg.test_size))


@dataclass
class Training:
    """What build_training makes: the bare model on its device, and what trains and feeds it."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: nn.Module
    normalize: nn.Module
    train_loader: object
    test_loader: object


def build_training(cfg, env, data) -> Training:
    """The model, optimizer, scaler, loss, loaders and normalisation: one build path for train(),
    --evaluate and bench.py. `data`: dataset_utils.load_checked_data's (its train split may be None)."""
    device = env.device
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = build_model(cfg, data.spec)
    if cfg.sync_bn:  # before DDP, so that DDP all-reduces the statistics within each forward
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # On CUDA the model is kept channels_last, the layout cuDNN's fastest convolutions want.
    model = model.to(device, memory_format=torch.channels_last if device.type == "cuda" else torch.preserve_format)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                                weight_decay=cfg.weight_decay, fused=device.type == "cuda")  # LR: set every step
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp_dtype == torch.float16)  # bf16 needs none
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing, reduction="sum")  # train_step averages
    torch.manual_seed(cfg.seed + env.rank)  # dropout then differs across ranks, as it should
    # The training loader's sampler, dataset_utils.EpochSampler, plays DistributedSampler's part (set_epoch): each
    # rank its share of every global batch, a new order per epoch; unlike it, it pads nothing, deals micro-batches
    # as virtual ranks (accumulation trains as more GPUs would), starts mid-epoch. Test: rank r scores r, r + W, ...
    train_loader, test_loader = dataset_utils.build_loaders(
        data.train, data.test, batch_size=cfg.batch_size, rank=env.rank, world_size=env.world_size,
        accum_steps=cfg.accumulation_steps, eval_batch=cfg.eval_batch, seed=cfg.seed, workers=cfg.num_workers,
        pin_memory=device.type == "cuda", device=data.device, skip_bad_samples=cfg.skip_bad_samples)
    normalize = dataset_utils.Normalize(data.spec.mean, data.spec.std, device, channels_last=device.type == "cuda")
    return Training(model, optimizer, scaler, loss_fn, normalize, train_loader, test_loader)


def train_step(model, images, labels, *, normalize, optimizer, scaler, loss_fn, amp_dtype, micro_sizes,
               step_samples, step_log):
    """One optimizer step on this rank's share of a global batch of `step_samples` samples, in micro-batches
    of `micro_sizes` (EpochSampler.step_split); `loss_fn` sums; `step_log` (utils.StepLog) times its phases.
    Returns the step's loss sums on the device (utils.loss_stats): a read on the host would stall the GPU."""
    device = normalize.scale.device
    images = normalize(images.to(device, non_blocking=True))
    labels = labels.to(device, non_blocking=True)
    step_log.mark("data")  # since the previous step: the loader's next batch, its copy and normalisation
    optimizer.zero_grad(set_to_none=True)
    # DDP averages the ranks' gradients, so each rank divides its sum by the step's samples per rank:
    # the update is then the mean over the whole global batch, even when the last step is uneven.
    per_rank = step_samples / (dist.get_world_size() if dist.is_initialized() else 1)
    stats, kept_buffers = 0, None
    for k, (x, y) in enumerate(zip(images.split(micro_sizes), labels.split(micro_sizes))):
        # DDP all-reduces the gradients in the last micro-step's backward, overlapped; the others accumulate.
        with utils.sync_gradients(model, enabled=k == len(micro_sizes) - 1):
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = loss_fn(model(x), y)  # an empty micro-batch gives 0 and leaves BN's statistics alone
            scaler.scale(loss / per_rank).backward()
        stats = stats + utils.loss_stats(loss.detach(), y.numel())
        # Micro-step k plays virtual rank r + k x world_size (EpochSampler). In a run of that many ranks, rank
        # 0's BatchNorm running statistics are the ones kept (by evaluate() and checkpoints), and they saw only
        # virtual rank 0's batch: so each rank keeps its micro-step 0's and undoes the others'.
        if len(micro_sizes) > 1 and k == 0:
            kept_buffers = [b.detach().clone() for b in model.buffers()]
    step_log.mark_backward()  # forward and backward, then the all-reduce's tail that backward did not hide
    for buffer, kept in zip(model.buffers(), kept_buffers or []):
        buffer.copy_(kept)
    scaler.step(optimizer)  # with fp16, skipped when the gradients hold inf/NaN
    scaler.update()
    step_log.mark("optimizer")
    return stats


def train_one_epoch(model, training: Training, *, cfg, epoch, progress, stop, checkpoint, step_log) -> bool:
    """Train the rest of `epoch` from progress.position (`step_log`: progress lines, time split). True if the
    ranks agreed to stop (a stop request), with a checkpoint saved; UserError if the loss went non-finite."""
    loader, optimizer, device = training.train_loader, training.optimizer, training.normalize.scale.device
    n = loader.batch_sampler.num_samples  # training samples per epoch
    model.train()
    loader.batch_sampler.set_epoch(epoch, start=progress.position, skipped=progress.skipped)  # after a resume: the rest
    # Loss sum over finite losses, their n, and all n. A resumed epoch's sums so far count once: on rank 0.
    first = not dist.is_initialized() or dist.get_rank() == 0
    sums = torch.tensor(progress.sums if first else [0.0] * 3, dtype=torch.float64, device=device)
    steps_per_epoch = progress.step + len(loader.batch_sampler)  # steps done + the steps left from the start set
    t0 = time.perf_counter() - progress.elapsed_s
    step_log.start()
    for images, labels in loader:
        step_samples, micro_sizes = loader.step_split(progress.position)  # the last step may be short; unread: gaps
        done = progress.position + step_samples
        # The LR follows the samples seen: the step's start and end in epochs (epoch - 1 + fraction done),
        # so a resume with another batch size keeps its schedule.
        lr = cfg.lr * utils.lr_factor(epoch - 1 + progress.position / n, epoch - 1 + done / n, epochs=cfg.epochs,
                                      warmup_epochs=cfg.warmup_epochs, schedule=cfg.lr_schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        sums += train_step(model, images, labels, normalize=training.normalize, optimizer=optimizer,
                           scaler=training.scaler, loss_fn=training.loss_fn, amp_dtype=cfg.amp_dtype,
                           micro_sizes=micro_sizes, step_samples=step_samples, step_log=step_log)
        progress.position, progress.step = done, progress.step + 1
        step_log.update(epoch, progress.step, steps_per_epoch, done, sums, t0)  # a progress line, if due
        if utils.stop_or_checkpoint_mid_epoch(progress, sums, t0=t0, cfg=cfg, stop=stop, checkpoint=checkpoint,
                                              loader=loader, allow_nonfinite=training.scaler.is_enabled()):
            return True
        step_log.end_step()
    # The epoch's loss sums over all ranks: this waits for the slowest rank (the original's barrier): an honest time.
    if dist.is_initialized():
        dist.all_reduce(sums)
    step_log.end_epoch()
    progress.sums, progress.elapsed_s = sums.tolist(), time.perf_counter() - t0
    return False


@torch.no_grad()
def evaluate(model, loader, *, normalize, device, amp_dtype, expected_count: int) -> dict:
    """Loss, top-1 and top-5 over the whole test set, exact for any world size: each rank scores its shard, and
    the sums (not per-rank means) are all-reduced, so uneven shards weigh right. `model` is the bare model: DDP's
    forward may broadcast, and a rank with an empty shard would not join. The count check: every image once."""
    # Each rank's BatchNorm running statistics drifted apart in training (each saw its own batches; DDP does not
    # re-send them): rank 0's go to every rank, so that all evaluate the one model rank 0 saves.
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
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
    if dist.is_initialized():
        dist.all_reduce(sums)  # sums, not means: exact whatever the shards' sizes
    loss_sum, top1, top5, count = sums.tolist()
    if int(count) != expected_count:
        raise RuntimeError(f"evaluation scored {int(count)} images, but the test set has {expected_count}")
    return {"val_loss": loss_sum / count, "val_acc": top1 / count, "val_top5": top5 / count, "val_count": int(count)}


def train(cfg, env, found, lock) -> int:
    """The recipe. Every rank runs all of it; rank 0 alone prints and writes. `found`: the checkpoint
    this run continues (utils.find_checkpoint), `lock`: this run's hold on the out-dir."""
    # ------------------------------------------------------------------ data, then the model and its training
    if found.finished:  # a finished run rerun with the same command (a requeue, say): nothing to train
        utils.log(found.finished)
        return 0
    data = dataset_utils.load_checked_data(load_data, cfg, env, found)  # the checkpoint's data, if resuming
    utils.log_start(cfg, env, data, found, parser=get_args_parser())  # the original script's first lines, LR, data
    training = build_training(cfg, env, data)
    model = eval_model = training.model  # the bare model: evaluate() and checkpoints use it

    # ------------------------------------------------------------------ resume, then DDP
    # What a checkpoint holds. ADAPT: register other state a resume needs (checkpoint.add).
    checkpoint = utils.Checkpoint(cfg, env, data, model_config=model_config(cfg, data.spec), lock=lock,
                                  model=model, optimizer=training.optimizer, scaler=training.scaler)
    progress = checkpoint.restore(found)  # where training stands: epoch 0, or the checkpoint's place
    # Progress lines, and where each rank's step time goes, side by side at each epoch's end (--profile: traces).
    step_log = utils.StepLog(cfg.log_every, env.device, profile_dir=cfg.profile and f"{cfg.out_dir}/profile")
    if env.distributed:  # DDP all-reduces (averages) the gradients in backward; bucket views spare a copy.
        # No buffer broadcast before each forward (a collective every step): training reads no BatchNorm running
        # statistics; evaluate() and checkpoints take rank 0's. ADAPT: a model whose forward reads them needs it.
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                    gradient_as_bucket_view=True, find_unused_parameters=cfg.find_unused_parameters,
                    **utils.NO_FORWARD_BUFFER_SYNC)
        step_log.watch_ddp(model)  # DDP's own all-reduce, timed; parameters left out of the loss said in one line
    if cfg.compile:  # a static graph per shape (the last batch is smaller)
        model, eval_model = torch.compile(model, dynamic=False), torch.compile(eval_model, dynamic=False)

    # ------------------------------------------------------------------ train and evaluate, epoch by epoch
    checkpoint.check_room()  # a full disk is refused now, not after an epoch's work
    run_files = utils.RunFiles(cfg, env, data, history=progress.history, lock=lock)  # config.json, metrics, ...
    with utils.StopRequest() as stop:  # SIGUSR1/SIGTERM/Ctrl-C and the stop file, caught while the loop runs
        for epoch in progress.epochs_left(cfg.epochs):
            if train_one_epoch(model, training, cfg=cfg, epoch=epoch, progress=progress, stop=stop,
                               checkpoint=checkpoint, step_log=step_log):
                return stop.exit_status  # a stop request mid-epoch, checkpointed: run again to resume
            stopping = stop.check(env.device, progress.sums, training.scaler.is_enabled())  # agreed; NaN raises
            val = evaluate(eval_model, training.test_loader, normalize=training.normalize, device=env.device,
                           amp_dtype=cfg.amp_dtype, expected_count=len(data.test))
            metrics = progress.finish_epoch(epoch, val, lr=training.optimizer.param_groups[0]["lr"], cfg=cfg,
                                            timing=step_log.finish_epoch(env.rank))  # every rank's time split
            utils.log_epoch(metrics, cfg.epochs)  # the original script's four lines, and a rank that held others back
            checkpoint.save(progress)
            run_files.add_epoch(metrics)
            if progress.stopped_early:
                utils.log(f"Target accuracy reached. Early stopping after epoch {epoch}.")
                break
            if stopping and epoch < cfg.epochs:  # a stop request at the epoch's end
                utils.log(f"Stop requested ({stop.reason}) after epoch {epoch}: checkpoint saved; exiting with status "
                          f"{stop.exit_status} to be resumed.")
                return stop.exit_status
            if epoch == cfg.stop_after_epoch and epoch < cfg.epochs:
                utils.log(f"Stopping after epoch {epoch} as asked (--stop-after-epoch); run again to resume.")
                break
    run_files.finish(progress)  # summary.json and the original script's summary lines
    return 0


def evaluate_checkpoint(cfg, env, found) -> int:
    """--evaluate: score the checkpoint on its test set, with the model and data its config names."""
    data = dataset_utils.load_checked_data(load_data, cfg, env, found, train=False)  # its spec: the checkpoint's
    training = build_training(cfg, env, data)
    checkpoint = utils.Checkpoint(cfg, env, data, model_config=model_config(cfg, data.spec), model=training.model)
    progress = checkpoint.restore(found)  # the weights (and the model it must be) only: nothing else registered
    model = torch.compile(training.model, dynamic=False) if cfg.compile else training.model
    utils.log(f"Evaluating {found.path} ({found.describe_model()}, {progress.epoch} of {cfg.epochs} epochs "
              f"trained) on {len(data.test)} test images with {env.world_size} processes")
    metrics = evaluate(model, training.test_loader, normalize=training.normalize, device=env.device,
                       amp_dtype=cfg.amp_dtype, expected_count=len(data.test))
    utils.RunFiles.write_evaluation(metrics, cfg=cfg, env=env, epoch=progress.epoch, path=found.path)  # eval.json
    return 0


def main(args, explicit=frozenset()) -> int:
    """Join the other processes, take the out-dir, find the checkpoint, make the config, then train (or only
    evaluate); tear down whatever happens. A UserError: every rank out, one line from rank 0, exit 2 (74: a write)."""
    lock = None
    try:
        env = utils.init_distributed(args.device, args.timeout)  # rank, device, process group: NCCL or gloo
        utils.check_args(args, env.world_size, env.device)  # after init: the ranks can wait for rank 0 to say why
        lock = None if args.evaluate else utils.lock_out_dir(args.out_dir, env)  # one run per out-dir
        found = utils.find_checkpoint(args, explicit, env)  # the checkpoint to continue, and the flags it rules
        cfg = utils.make_config(args, env, found)  # every flag and what the world makes of them, computed once
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels
        return evaluate_checkpoint(cfg, env, found) if cfg.evaluate else train(cfg, env, found, lock)
    except utils.UserError as e:
        return utils.leave_on_user_error(e)
    finally:  # the lock, then the process group: every rank, whatever happened
        if lock:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(utils.run_cli(main, get_args_parser(), RECIPES))  # flags and --recipe; Ctrl-C, dead peers in a line
