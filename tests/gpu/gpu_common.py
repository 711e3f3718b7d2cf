"""What the GPU tests share: whether they run on CUDA or as the CPU stand-in (GPU_TESTS_ON_CPU=1; test_gpu.py's
docstring), the device, the launch, a small run's flags."""
import os

import pytest
import torch

import support
from support import TINY

CUDA = torch.cuda.is_available()
STAND_IN = not CUDA and os.environ.get("GPU_TESTS_ON_CPU") == "1"  # the CPU stand-in (test_gpu.py's docstring)
SKIP_WITHOUT_A_GPU = pytest.mark.skipif(not (CUDA or STAND_IN), reason="needs a CUDA GPU (run on a GPU node); "
                                        "GPU_TESTS_ON_CPU=1 runs a CPU stand-in")
GPUS = torch.cuda.device_count() if CUDA else 2  # the stand-in: 2 CPU processes
NPROC = min(2, GPUS)
DEVICE = "cuda" if CUDA else "cpu"
UNIT = "GPUs" if CUDA else "CPU processes"  # as the log's lines name them


def launch(*args, **kwargs):
    """support.launch with the interpreter's own exit (fast_exit=False), as a user's run has it: with NCCL, a
    DDP model freed only by the final garbage collections, after its process group, can abort the process
    there (train_ddp.main collects before it destroys the group); and a GPU node has the cores to spare."""
    return support.launch(*args, fast_exit=False, **kwargs)


RUN = ["--dataset", "synthetic", "--train-size", 2048, "--test-size", 256, "--batch-size", 128, "--epochs", 2,
       "--device", DEVICE, *TINY]
# The stand-in's CPU has no fp16 or bf16 worth the name: full precision there.
AMP = ["--amp", "fp16"] if CUDA else ["--amp", "off"]

