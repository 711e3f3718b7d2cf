"""Launched by torchrun: one train_ddp.train_step on one global batch.

Usage: ddp_step.py OUT_FILE GLOBAL_BATCH
BatchNorm stays in eval mode (running statistics), so per-rank batch statistics play no part:
with N ranks of GLOBAL_BATCH/N the step must equal one rank with GLOBAL_BATCH.
"""
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support
import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import dataset_utils as du  # noqa: E402
import support  # noqa: E402
import train_ddp  # noqa: E402
import train_utils  # noqa: E402
from machinery.timing import StepLog  # noqa: E402
from train_ddp import init_distributed  # noqa: E402

def step_and_save():
    """The step; its DDP model lives only in here, so that it is gone before the process group is."""
    out, batch = sys.argv[1], int(sys.argv[2])
    args = train_utils.get_args_parser().parse_args(["--depth", "10", "--widen-factor", "1", "--dropout", "0"])
    env = init_distributed("cpu", timeout_s=60)
    data = du.load_split("synthetic", "", True, size=batch)
    loader, _ = support.build_loaders(data, data, batch_size=batch, rank=env.rank, world_size=env.world_size,
                                      accum_steps=1, eval_batch=batch, seed=0, workers=0, pin_memory=False)
    torch.manual_seed(0)
    model = train_ddp.build_model(args, du.measure_data(data, data))
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()  # train_step leaves the mode to its caller
    if env.world_size > 1:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    normalize = du.Normalize(du.CIFAR100_MEAN, du.CIFAR100_STD, torch.device("cpu"))
    loader.batch_sampler.set_epoch(1)
    images, labels = next(iter(loader))
    assert len(labels) == batch // env.world_size, "one step of one global batch"
    sum_loss = torch.nn.CrossEntropyLoss(reduction="sum")  # what train_step takes
    step_samples, micro_sizes = loader.batch_sampler.step_split(0)
    assert micro_sizes == [len(labels)]
    training = train_ddp.Training(model, optimizer, scaler, sum_loss, normalize, loader, None)
    cfg = SimpleNamespace(amp_dtype=None, clip_grad_norm=None)
    step_log = StepLog(0, normalize.scale.device)
    train_ddp.train_step(model, images, labels, split=(step_samples, micro_sizes), training=training, cfg=cfg,
                         step_log=step_log)
    if env.is_main:
        torch.save(getattr(model, "module", model).state_dict(), out)


step_and_save()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # after the DDP model is gone: else gloo may abort at exit
