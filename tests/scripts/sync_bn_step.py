"""Launched by torchrun on a GPU machine: train_ddp.train_step on one global batch, BatchNorm in train mode.

Usage: sync_bn_step.py OUT_FILE GLOBAL_BATCH SYNC_BN(0|1)
Each rank takes its shard of the global batch from the real sampler. With SyncBatchNorm the batch
statistics are those of the whole global batch, so N ranks of GLOBAL_BATCH/N must equal one rank with
GLOBAL_BATCH, running statistics included; without it, each rank normalises over its own shard only.
NCCL needs a GPU per rank; with fewer GPUs than ranks, the ranks share GPU 0 over gloo, which
SyncBatchNorm supports too (it all-gathers the statistics): the math is the same, only slower.
"""
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import dataset_utils as du  # noqa: E402
import support  # noqa: E402
import train_ddp  # noqa: E402
import train_utils  # noqa: E402
from machinery.launch import read_dist_env  # noqa: E402
from machinery.timing import StepLog  # noqa: E402

def step_and_save():
    """The step; its DDP model lives only in here, so that it is gone before the process group is."""
    out, batch, sync_bn = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False  # float32 throughout: tolerance then means float summation order
    torch.backends.cuda.matmul.allow_tf32 = False
    args = train_utils.get_args_parser().parse_args(["--depth", "10", "--widen-factor", "2", "--dropout", "0"])
    env = read_dist_env()
    shared_gpu = env.world_size > torch.cuda.device_count()
    device = torch.device("cuda", 0 if shared_gpu else env.local_rank)
    torch.cuda.set_device(device)
    if env.world_size > 1:
        dist.init_process_group("gloo" if shared_gpu else "nccl")
    data = du.load_split("synthetic", "", True, size=batch)
    loader, _ = support.build_loaders(data, data, batch_size=batch, rank=env.rank, world_size=env.world_size,
                                      accum_steps=1, eval_batch=batch, seed=0, workers=0, pin_memory=False,
                                      device=device)
    torch.manual_seed(0)
    model = train_ddp.build_model(args, du.measure_data(data, data))
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device).train()
    if env.world_size > 1:
        model = DDP(model, device_ids=[device])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    normalize = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, device)
    loader.batch_sampler.set_epoch(1)
    for step, (images, labels) in enumerate(loader):
        assert len(labels) == batch // env.world_size, "one step of one global batch"
        sum_loss = torch.nn.CrossEntropyLoss(reduction="sum")  # what train_step takes
        training = train_ddp.Training(model, optimizer, scaler, sum_loss, normalize, loader, None)
        cfg = SimpleNamespace(amp_dtype=None, clip_grad_norm=None)
        step_log = StepLog(0, normalize.scale.device)
        train_ddp.train_step(model, images, labels, split=(batch, [len(labels)]), training=training, cfg=cfg,
                             step_log=step_log)
        break
    if env.is_main:
        torch.save({k: v.cpu() for k, v in getattr(model, "module", model).state_dict().items()}, out)


step_and_save()
if dist.is_initialized():
    dist.destroy_process_group()  # after the DDP model is gone: else gloo may abort at exit
