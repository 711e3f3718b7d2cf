"""Train a WideResNet on CIFAR-100 with DistributedDataParallel.

    python train_ddp.py --recipe cpu-try                              # one process, about 70 s on 2 CPU cores
    torchrun --standalone --nproc_per_node=4 train_ddp.py             # one node, 4 GPUs
    sbatch jobs/multigpu.sh                                           # Slurm: --recipe wrn-paper

One file for plain python and torchrun: the launcher's RANK, LOCAL_RANK and WORLD_SIZE say whether this is one
process of many, each on the GPU of its LOCAL_RANK with NCCL, or on CPU with gloo. Flags: train_utils.py.
Six places are marked ADAPT (1/6 to 6/6); an image classifier changes the first three: model, data, augmentation.
Then the DDP story: train_step, train_one_epoch, evaluate, and train(), which wraps the model in DDP and loops.
"""
import datetime
import functools
import gc
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# Copied into a folder of your repository (the README's copy line), this file finds your own modules too: the folder
# above its own is searched after it, so that the ADAPT places can import your code (this copy's names win a clash).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataset_utils
import train_utils as utils
from machinery.cli import run_cli
from machinery.comm_hooks import torch_comm_hook
from machinery.errors import UserError, all_gather, leave_on_user_error
from machinery.launch import DistEnv, host_name, read_launcher, rendezvous
from machinery.lock import lock_out_dir
from machinery.output import log
from machinery.records import RunFiles
from machinery.signals import STOP_CHECK_EVERY
from machinery.timing import StepLog
from model import WideResNet


def build_model(cfg, data) -> nn.Module:
    # ADAPT (1/6): your model here, taking its input channels and classes from `data` (a DataSpec); in
    # model_config what fixes its shapes (a checkpoint must match them; "name" is what messages call it).
    return WideResNet(cfg.depth, cfg.widen_factor, num_classes=data.num_classes, dropout=cfg.dropout,
                      in_channels=data.channels)


def model_config(cfg, data) -> dict:
    return {"name": f"WRN-{cfg.depth}-{cfg.widen_factor}", "depth": cfg.depth,
            "widen_factor": cfg.widen_factor, "in_channels": data.channels, "num_classes": data.num_classes}


def load_data(cfg, env, train: bool = True):
    """The (train, test) splits (train: None if not asked for). The rest follows from what this returns."""
    # ADAPT (2/6): your data here: ImageData (uint8 N x C x H x W images, int64 labels) when they fit in memory,
    # else a Dataset of (uint8 C x H x W, label). Image files as root/<class>/<image>: dataset_utils.image_folder,
    # with folder_classes and mean_std (the README's worked examples; docs/adapt.md).
    if cfg.dataset == "cifar100":
        dataset_utils.prepare_cifar100(cfg.data_dir, env)  # one process per node downloads and checks it
    return (dataset_utils.load_split(cfg.dataset, cfg.data_dir, True, cfg.train_size) if train else None,
            dataset_utils.load_split(cfg.dataset, cfg.data_dir, False, cfg.test_size))


def build_transforms(cfg, data) -> tuple:
    """(train, test, batch) in torchvision.transforms.v2: each image's (None: as it is) and each training
    micro-batch's. The loaders seed torch's generator per image and micro-batch (docs/adapt.md)."""
    from torchvision.transforms import v2  # here: torchvision's import costs every process a second
    # ADAPT (3/6): your augmentation. Each image's transform takes a uint8 C x H x W tensor and returns one, of the
    # model's input size (a PIL image: end with v2.PILToTensor()). Photos, say: train [v2.RandomResizedCrop(224),
    # v2.RandomHorizontalFlip()], test [v2.Resize(256), v2.CenterCrop(224)]. A pipeline other than the default runs
    # per image (in DataLoader workers, or on the GPU with --loader gpu); the default is batched on the GPU.
    # The default, the WRN paper's: zero-pad an eighth of each side (4 for 32), crop back, mirror.
    pad_y, pad_x = dataset_utils.crop_padding(data.height, data.width)
    crop_flip = [v2.RandomCrop((data.height, data.width), padding=[pad_x, pad_y]), v2.RandomHorizontalFlip()]
    train = [*crop_flip]
    if cfg.auto_augment == "ta_wide":
        train.append(v2.TrivialAugmentWide())
    if cfg.random_erase:  # filled with the mean colour: 0 once normalised, as torchvision's after Normalize
        train.append(v2.RandomErasing(cfg.random_erase, value=[round(255 * m) for m in data.mean]))
    mix = [v2.MixUp(alpha=cfg.mixup_alpha, num_classes=data.num_classes)] if cfg.mixup_alpha else []
    mix += [v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=data.num_classes)] if cfg.cutmix_alpha else []
    batch = v2.RandomChoice(mix) if len(mix) == 2 else (mix[0] if mix else None)  # both: one of them, 50/50
    if train == crop_flip:  # the default alone: the device loader crops and flips whole batches on the GPU
        return (dataset_utils.CropFlip(v2.Compose(train), pad=(pad_y, pad_x), size=(data.height, data.width)), None,
                batch)
    return v2.Compose(train), None, batch


@dataclass
class Training:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: nn.Module
    normalize: nn.Module
    train_loader: object
    test_loader: object
    val_loader: object = None  # --val-size: the held-out training samples, scored as the test set is
    # --model-ema: the average of the weights and buffers, evaluated and saved
    ema: AveragedModel | None = None


def build_training(cfg, env, data) -> Training:
    """Model, optimizer, scaler, loss, loaders, normalisation: one path for train(), --evaluate, bench.py."""
    device = env.device
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = build_model(cfg, data.spec)
    if cfg.sync_bn:  # before DDP, so that DDP all-reduces the statistics within each forward
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # The model is kept channels_last, the layout the fastest convolutions want: cuDNN's on GPUs, oneDNN's on
    # CPUs (a training step 1.1 to 1.4 times as fast there, measured on WRNs from 10-1 to 16-4).
    model = model.to(device, memory_format=torch.channels_last)
    params = model.parameters()
    if cfg.norm_weight_decay is not None:  # biases and norm layers' scales and shifts: the 1-d tensors
        params = [{"params": [p for p in model.parameters() if p.dim() > 1]},
                  {"params": [p for p in model.parameters() if p.dim() <= 1],
                   "weight_decay": cfg.norm_weight_decay}]
    optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                                weight_decay=cfg.weight_decay, fused=env.cuda)  # LR: set every step
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp_dtype == torch.float16)  # bf16 needs none
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing, reduction="sum")  # train_step averages
    torch.manual_seed(cfg.seed + env.rank)  # dropout then differs across ranks, as it should
    # The loaders' shards are torch's DistributedSampler's (dataset_utils.ShardSampler: padding left off, a resumed
    # epoch's start, start_at): training, one per virtual rank (a micro-step of this rank), a new order each epoch
    # (set_epoch, torch's); test, unshuffled: rank r scores r, r + W, ..., each image once.
    train_loader, test_loader, val_loader = dataset_utils.build_loaders(data, cfg, env,
                                                                        transforms=build_transforms(cfg, data.spec))
    normalize = dataset_utils.Normalize(data.spec.mean, data.spec.std, device, channels_last=True)
    # The EMA's first update copies the weights; each later one moves it by 1 - decay (per step, cfg.ema_decay).
    ema = (AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay), use_buffers=True)
           if cfg.model_ema else None)
    return Training(model, optimizer, scaler, loss_fn, normalize, train_loader, test_loader, val_loader,
                    ema=ema)


def train_step(model, images, labels, *, split, training: Training, cfg, step_log) -> torch.Tensor:
    """One optimizer step on this rank's share of a global batch: `split` is the step's samples over all ranks and
    this rank's micro-batch sizes. Returns the step's sums on the device (a host read would stall the GPU)."""
    normalize, optimizer, scaler, loss_fn = (training.normalize, training.optimizer, training.scaler,
                                             training.loss_fn)
    (step_samples, micro_sizes), device, amp_dtype = split, normalize.scale.device, cfg.amp_dtype
    images = normalize(images.to(device, non_blocking=True))
    labels = labels.to(device, non_blocking=True)
    step_log.mark("data")  # since the previous step: the loader's next batch, its copy and normalisation
    optimizer.zero_grad(set_to_none=True)
    # DDP averages the ranks' gradients, so each rank divides its sum by the step's samples per rank:
    # the update is then the mean over the whole global batch, even when the last step is uneven.
    per_rank = step_samples / (dist.get_world_size() if dist.is_initialized() else 1)
    stats, kept_buffers = 0, None
    ddp = getattr(model, "_orig_mod", model)  # the DDP model, under torch.compile's wrapper if compiled
    for k, (x, y) in enumerate(zip(images.split(micro_sizes), labels.split(micro_sizes))):
        # DDP all-reduces the gradients in the last micro-step's backward, overlapped with it; in the others,
        # no_sync() only accumulates them (an all-reduce per micro-step would cost A times the communication).
        with ddp.no_sync() if k < len(micro_sizes) - 1 and isinstance(ddp, DDP) else nullcontext():
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(x)
                loss = loss_fn(logits, y)  # an empty micro-batch gives 0 and leaves BN's statistics alone
            scaler.scale(loss / per_rank).backward()
        hits = (logits.detach().argmax(1) == (y if y.dim() == 1 else y.argmax(1))).sum()  # soft: larger share
        stats = stats + utils.step_stats(loss.detach(), len(y), correct=hits)
        # Micro-step k plays virtual rank r + k x world_size (StepSampler). In a run of that many ranks, rank
        # 0's BatchNorm running statistics are the ones kept (by evaluate() and checkpoints), and they saw
        # only virtual rank 0's batch: so each rank keeps its micro-step 0's and undoes the others'.
        if len(micro_sizes) > 1 and k == 0:
            kept_buffers = [b.detach().clone() for b in model.buffers()]
    step_log.mark("compute")  # forward and backward, then the all-reduce's tail that backward did not hide
    for buffer, kept in zip(model.buffers(), kept_buffers or []):
        buffer.copy_(kept)
    if cfg.clip_grad_norm:  # the all-reduced gradients' norm, the same on every rank; fp16: unscaled first
        scaler.unscale_(optimizer)
        stats += utils.step_stats(grad_norm=nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm))
    scaler.step(optimizer)  # with fp16, skipped when the gradients hold inf/NaN
    scaler.update()
    if training.ema is not None:  # the same update on every rank: the weights are the same after the step
        training.ema.update_parameters(model)
    step_log.mark("optimizer")
    return stats


def train_one_epoch(model, training: Training, *, epoch: int, cfg, progress, step_log, checks, checkpoint) -> bool:
    """Train the rest of `epoch` from progress.position. Every STOP_CHECK_EVERY steps the ranks agree on what would
    end the run (unreadable samples, a non-finite loss, a stop request: a checkpoint, then True)."""
    loader, optimizer, device = training.train_loader, training.optimizer, training.normalize.scale.device
    n = loader.batch_sampler.num_samples  # training samples per epoch
    model.train()
    loader.batch_sampler.set_epoch(epoch)  # torch's DistributedSampler idiom: a new order each epoch
    # What a resume adds: the epoch from progress.position on (0 unless it was checkpointed mid-way), with the
    # unreadable samples it skipped so far (progress.skipped, which the loader adds to)
    loader.batch_sampler.start_at(progress.position, skipped=progress.skipped)
    # The epoch's sums (utils.EPOCH_SUMS). A resumed epoch's sums so far count once: on rank 0.
    rank = dist.get_rank() if dist.is_initialized() else 0
    sums = torch.tensor(progress.sums if rank == 0 else [0.0] * len(progress.sums), dtype=torch.float64,
                        device=device)
    steps_per_epoch = progress.step + len(loader.batch_sampler)  # steps done + steps left from the start
    epoch_start = time.perf_counter() - progress.elapsed_s
    step_log.mark("start")
    for i, (images, labels) in enumerate(loader):
        split = loader.step_split(progress.position)  # the last step may be short; unread samples: gaps
        done = progress.position + split[0]
        # The LR follows the samples seen: the step's start and end in epochs (epoch - 1 + fraction done),
        # so a resume with another batch size keeps its schedule.
        lr = cfg.lr * utils.lr_factor(epoch - 1 + progress.position / n, epoch - 1 + done / n,
                                      epochs=cfg.epochs, warmup_epochs=cfg.warmup_epochs,
                                      schedule=cfg.lr_schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        sums += train_step(model, images, labels, split=split, training=training, cfg=cfg, step_log=step_log)
        if i == 0:  # DDP needs every parameter in every step's loss: a gap is named now, not a hang later
            utils.check_parameters_used(model)
        progress.position, progress.step = done, progress.step + 1
        # The progress line, when due, reads the mean loss: sums[:2], the loss over finite samples and their count.
        step_log.update(epoch, progress.step, steps_per_epoch, done, sums[:2], epoch_start)
        checkpoint_due = cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0
        if progress.step % STOP_CHECK_EVERY == 0 or checkpoint_due:  # collectives: every rank comes
            stopping = checks.check(sums)  # unreadable samples, a NaN loss, a stop request: on any rank
            if stopping or checkpoint_due:
                progress.elapsed_s = time.perf_counter() - epoch_start
                total = sums.clone()
                if dist.is_initialized():
                    dist.all_reduce(total)  # the epoch's sums so far, over all ranks, for the checkpoint
                progress.sums = total.tolist()
                checkpoint.save(progress)
            if stopping:
                checks.say_stopped(f"Stop requested ({checks.reason}) in epoch {epoch} after step {progress.step}: "
                                   f"checkpoint saved in {cfg.out_dir}; exiting with status {checks.exit_status} "
                                   f"to be resumed.")
                return True
        step_log.mark("step")
    # The epoch's sums over all ranks: this waits for the slowest rank (the original's barrier): honest time.
    if dist.is_initialized():
        dist.all_reduce(sums)
    step_log.mark("end")
    progress.sums, progress.elapsed_s = sums.tolist(), time.perf_counter() - epoch_start
    return False


@torch.no_grad()
def evaluate(model, loader, *, normalize, amp_dtype, expected_count: int, tta: bool = False) -> dict:
    """Loss, top-1 and top-5 over the whole test set, exact for any world size: each rank scores its shard, and the
    sums (not means) are all-reduced. `model`: the bare model (a rank with an empty shard joins no DDP forward)."""
    device = normalize.scale.device
    # Each rank's BatchNorm running statistics drifted apart in training (each saw its own batches; DDP does
    # not re-send them): rank 0's go to every rank, so that all evaluate the one model rank 0 saves.
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
            if tta:  # the first logits copied: a CUDA graph (--compile-mode reduce-overhead) reuses its output
                logits = (logits.clone() + model(images.flip(3))) / 2
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
        hits = logits.topk(min(5, logits.size(1)), dim=1).indices == labels[:, None]  # is the k-th best guess right?
        batch_count = torch.full((), labels.numel(), dtype=torch.float64, device=device)  # on the device: no sync
        sums += torch.stack([loss.double(), hits[:, 0].sum().double(), hits.any(dim=1).sum().double(),
                             batch_count])
    if dist.is_initialized():
        dist.all_reduce(sums)  # sums, not means: exact whatever the shards' sizes
    loss_sum, top1, top5, count = sums.tolist()
    if int(count) != expected_count:
        raise RuntimeError(f"evaluation scored {int(count)} images, but the split has {expected_count}")
    return {"val_loss": loss_sum / count, "val_acc": top1 / count, "val_top5": top5 / count,
            "val_count": int(count)}


def train(cfg, env, found, lock) -> int:
    """The recipe: every rank runs all of it; rank 0 alone prints and writes. `found`: the checkpoint continued."""
    # ------------------------------------------------------------------ data, then the model and its training
    if found.finished:  # a finished run rerun with the same command (a requeue, say): said, nothing to train
        return 0
    data = dataset_utils.load_checked_data(load_data, cfg, env, found)  # the checkpoint's data, if resuming
    utils.log_start(cfg, env, data, found)  # the original's first lines, the LR, the data
    training = build_training(cfg, env, data)
    model = training.model  # the bare model: checkpoints hold it; evaluate() scores it, or its weight EMA
    eval_model = training.ema.module if training.ema is not None else model

    # ------------------------------------------------------------------ resume, then DDP
    # What a checkpoint holds. ADAPT (4/6): other state a resume needs goes in `optional`, with what stands in for it
    # in a checkpoint written before it (the weight EMA's, if on).
    checkpoint = utils.Checkpoint(cfg, env, data, model_config=model_config(cfg, data.spec), lock=lock,
                                  model=model, optimizer=training.optimizer, scaler=training.scaler,
                                  optional={"model_ema": (training.ema, "the average starts from the weights")})
    progress = checkpoint.restore(found)  # where training stands: epoch 0, or the checkpoint's place
    # Progress lines with the run's ETA, and where each rank's step time goes (--profile: traces).
    step_log = StepLog(cfg.log_every, env.device, profile_dir=cfg.profile and f"{cfg.out_dir}/profile",
                       epochs=cfg.epochs)
    # ADAPT (5/6): a model whose forward in training reads its buffers needs them in sync: drop wrap_ddp's
    # NO_FORWARD_BUFFER_SYNC (DDP then broadcasts rank 0's before each forward).
    if env.distributed:
        model = wrap_ddp(model, cfg, env, step_log)
    if cfg.compile:  # a static graph per shape (the last batch is smaller)
        model, eval_model = (torch.compile(m, dynamic=False, mode=cfg.compile_mode) for m in (model, eval_model))

    # ------------------------------------------------------------------ train and evaluate, epoch by epoch
    run_files = RunFiles(cfg, env, data, history=progress.history, lock=lock)  # config.json, ...
    # SIGUSR1/SIGTERM/Ctrl-C and the stop file, caught while the loop runs; a NaN loss; unreadable samples
    with utils.RunChecks(training.train_loader, env.device, allow_nonfinite=training.scaler.is_enabled()) as checks:
        # the epochs left, the first maybe begun; none once early stopping ended the run (a requeue after it)
        for epoch in range(progress.epoch + 1, cfg.epochs + 1) if not progress.stopped_early else ():
            if train_one_epoch(model, training, epoch=epoch, cfg=cfg, progress=progress, step_log=step_log,
                               checks=checks, checkpoint=checkpoint):
                return checks.exit_status  # a stop request mid-epoch, checkpointed: run again to resume
            stopping = checks.check(progress.sums)  # the epoch's last steps, agreed by all ranks
            score = functools.partial(evaluate, eval_model, normalize=training.normalize,
                                      amp_dtype=cfg.amp_dtype, tta=cfg.tta)
            eval_start = time.perf_counter()
            val = score(training.test_loader, expected_count=len(data.test))  # the original's "validation"
            if training.val_loader is not None:  # --val-size: the held-out split validates, the test reports
                test = {k.replace("val_", "test_"): v for k, v in val.items()}
                val = {**score(training.val_loader, expected_count=len(data.val)), **test}
            metrics = progress.finish_epoch(epoch, val, lr=training.optimizer.param_groups[0]["lr"], cfg=cfg,
                                            timing=step_log.finish_epoch(env.rank),  # every rank's time split
                                            eval_s=time.perf_counter() - eval_start)
            # Early stopping: the last --patience epochs all reached --target-accuracy (all-reduced: every rank
            # decides alike); never with --patience 0.
            recent = [m["val_acc"] for m in progress.history[-cfg.patience:]] if cfg.patience > 0 else []
            progress.stopped_early = (cfg.patience > 0 and len(recent) == cfg.patience
                                      and min(recent) >= cfg.target_accuracy)
            finished = epoch == cfg.epochs or progress.stopped_early  # the end of training
            # ADAPT (6/6): an option that finalises its state at the end of training does it here, `if finished:`,
            # before the last checkpoint and the summary (SWA: tools.bn_stats.recompute_bn_stats on its average).
            checkpoint.save(progress)
            run_files.add_epoch(metrics)  # the original's four lines, metrics.jsonl
            if finished:  # run_files.finish says so if early
                break
            if stopping:  # a stop request at the epoch's end
                checks.say_stopped(f"Stop requested ({checks.reason}) after epoch {epoch}: checkpoint saved; "
                                   f"exiting with status {checks.exit_status} to be resumed.")
                return checks.exit_status
            if epoch == cfg.stop_after_epoch:  # --stop-after-epoch: run_files.finish says so
                break
    run_files.finish(progress)  # why it ends here, summary.json and the original script's summary lines
    return 0


def wrap_ddp(model, cfg, env, step_log) -> DDP:
    """DDP averages the gradients in backward, a bucket (--bucket-cap-mb) once its gradients are in, overlapped with
    the rest of backward; bucket views spare a copy. --comm-hook changes what the all-reduce sends."""
    # No buffer broadcast before each forward (a collective every step): training reads no BatchNorm running
    # statistics; evaluate() and checkpoints take rank 0's (a model that reads them: train() says what to drop).
    model = DDP(model, device_ids=[env.local_rank] if env.cuda else None, bucket_cap_mb=cfg.bucket_cap_mb,
                gradient_as_bucket_view=True, find_unused_parameters=cfg.find_unused_parameters,
                **utils.NO_FORWARD_BUFFER_SYNC)
    # torch's hooks (torch.distributed.algorithms.ddp_comm_hooks): fp16_compress_hook or bf16_compress_hook (half
    # the bytes), or powerSGD_hook with its PowerSGDState (a low-rank approximation); (None, None): DDP's own.
    state, hook = torch_comm_hook(cfg, env)
    hook = step_log.timed_hook(hook)  # None: neither a hook nor timing, DDP's built-in C++ all-reduce
    if hook is not None:
        model.register_comm_hook(state, hook)
    return model


def evaluate_checkpoint(cfg, env, found) -> int:
    """--evaluate: score the checkpoint on its test set, with the model and data its config names."""
    data = dataset_utils.load_checked_data(load_data, cfg, env, found, train=False)  # its spec: the checkpoint's
    training = build_training(cfg, env, data)
    checkpoint = utils.Checkpoint(cfg, env, data, model_config=model_config(cfg, data.spec), model=training.model,
                                  optional={"model_ema": (training.ema, "the model's weights are scored")})  # if any
    progress = checkpoint.restore(found)  # the weights (and the model it must be) only: nothing else registered
    scores_ema = training.ema is not None and bool(training.ema.n_averaged)
    model = training.ema.module if scores_ema else training.model
    model = torch.compile(model, dynamic=False, mode=cfg.compile_mode) if cfg.compile else model
    log(f"Evaluating {found.path} ({found.describe_model()}{', its weight EMA' if scores_ema else ''}, "
        f"{progress.epoch} of {cfg.epochs} epochs trained) on {len(data.test)} test images with "
        f"{env.world_size} process{'es' if env.world_size > 1 else ''}")
    metrics = evaluate(model, training.test_loader, normalize=training.normalize, amp_dtype=cfg.amp_dtype,
                       expected_count=len(data.test), tta=cfg.tta)
    RunFiles.write_evaluation(metrics, cfg=cfg, env=env, epoch=progress.epoch, path=found.path,
                              top5=data.spec.num_classes > 5)  # and eval.json
    return 0


def init_distributed(device: str, timeout_s: float) -> DistEnv:
    """Who this process is (torchrun's variables; srun's tasks adopt them), its device, the process group: NCCL
    with one GPU per LOCAL_RANK, or gloo on CPUs. A plain `python train_ddp.py` is one process, in no group."""
    env = read_launcher(device)
    if "RANK" in os.environ:  # a launcher started this process as one of a group
        if env.cuda:
            torch.cuda.set_device(env.device)  # before the group, or every rank piles onto GPU 0
        # A collective that waits longer than `timeout` fails, with a line naming the ranks that never came.
        with rendezvous(env, timeout_s) as store:  # a failed meeting: one line, not a traceback
            dist.init_process_group(backend="nccl" if env.cuda else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=env.device if env.cuda else None, **store)
        env.nodes = len(set(all_gather(host_name())))  # the ranks count their hosts
    return env


def choose_kernels(*, deterministic: bool) -> None:
    """By default the fastest kernels for each input shape, found by timing them (which wins, so how sums round,
    may differ by run); --deterministic: the same kernels and sums every run, slower."""
    if deterministic:  # cuBLAS reads it when it first allocates its workspace: at the first matmul, after this
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    torch.use_deterministic_algorithms(deterministic, warn_only=True)


def main(args, explicit=frozenset()) -> int:
    """Join, lock the out-dir, find the checkpoint, make the config, train or evaluate, tear down."""
    lock = None
    try:
        if args.self_check:  # short runs of this file on the CPU, each guarantee said in a line (docs/adapt.md)
            utils.check_args(args, 1, torch.device("cpu"))  # bad flags: refused once, not in every run
            from machinery.self_check import run_self_check  # imported only here: a training run never needs it
            return run_self_check(os.path.abspath(__file__), sys.argv[1:], build_model=build_model,
                                  spec_type=dataset_utils.DataSpec)
        env = init_distributed(args.device, args.timeout)  # rank, device, process group: NCCL or gloo
        utils.check_args(args, env.world_size, env.device)  # after init: the ranks can wait for rank 0 to say why
        lock = None if args.evaluate else lock_out_dir(args.out_dir, env)  # one run per out-dir
        # the checkpoint to continue, and the flags it rules
        found = utils.find_checkpoint(args, explicit, env, rules=utils.RESUME_RULES)
        cfg = utils.make_config(args, env, found)  # every flag and what the world makes of them, computed once
        choose_kernels(deterministic=cfg.deterministic)
        return evaluate_checkpoint(cfg, env, found) if cfg.evaluate else train(cfg, env, found, lock)
    except UserError as e:
        return leave_on_user_error(e)
    finally:  # the lock, then the process group: every rank, whatever happened
        if lock:
            lock.release()
        if dist.is_initialized():
            # The DDP model holds the process group. An error raised on this rank (a failed write) leaves it in a
            # reference cycle, its exception's frames, that only the garbage collector frees: now, not during the
            # interpreter's exit after the group, where freeing it can abort the process ("terminate called without
            # an active exception").
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_cli(main, utils.get_args_parser(), utils.RECIPES))  # flags and --recipe; Ctrl-C, dead peers in a line
