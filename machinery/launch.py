"""Who this process is and how ranks meet: launcher env (torchrun, Slurm, none), device, process group, failures."""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from machinery.errors import RendezvousError, UserError, all_gather, note_host_in_store


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    nodes: int = 1  # the hosts the ranks run on: counted once the process group exists

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cuda(self) -> bool:
        """One GPU per process (NCCL); else the CPU (gloo)."""
        return self.device.type == "cuda"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def read_dist_env() -> DistEnv:
    """Rank and world size from torchrun's env (or srun's, after adopt_slurm_env), else one process. Reads only."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                       int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    return DistEnv()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU; use --device cpu or auto")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                        f"launch at most that many processes per node (--nproc_per_node)")
    return torch.device("cuda", local_rank)


def read_launcher(device: str) -> DistEnv:
    """DistEnv from the launcher (srun's env read as torchrun's), on `device`: auto, cuda or cpu (one GPU a rank)."""
    # torch's optimizers import torch._dynamo at their first step; imported then, after the process group's threads
    # started, it now and then aborts the process at exit ("terminate called without an active exception"). So import
    # it first, here: a loader worker may import the script's modules again and never needs it (a second).
    import torch._dynamo  # noqa: F401
    if "RANK" not in os.environ and int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        from machinery.launcher_env import adopt_slurm_env
        adopt_slurm_env()  # `srun python train_ddp.py`: one task per GPU, no torchrun
    env = read_dist_env()
    env.device = pick_device(device, env.local_rank)
    return env


@contextlib.contextmanager
def rendezvous(env: DistEnv, timeout_s: float):
    """Around init_process_group: yields its keywords besides backend and timeout ({}, or under a torchrun restart a
    fresh store namespace with rank and world size). A failed meeting (timeout, unreachable address) becomes a
    RendezvousError line; once met, each rank notes its host in the store, so a later timeout can name a missing one."""
    store = {}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        from machinery.launcher_env import restart_store  # torchrun keeps one store across --max-restarts
        store = restart_store(env, timeout_s)
    try:
        yield store
    except Exception as e:  # the store raises several types: DistStoreError, RuntimeError, TimeoutError
        from machinery.diagnose import describe_init_failure
        if (why := describe_init_failure(e, env, timeout_s, host=host_name())) is None:
            raise
        raise RendezvousError(why) from None
    note_host_in_store(env.rank, host_name())


def gather_ranks(env: DistEnv) -> list:
    """A collective: each rank's host, device, route and resolved rendezvous address, by rank (node count, run.json)."""
    master = master_address()
    return all_gather({"rank": env.rank, "local_rank": env.local_rank, "host": host_name(),
                       "address": route_source(master) if master else None, "master_address": master,
                       "device": torch.cuda.get_device_name(env.device) if env.cuda else "cpu"})


def default_workers(env: DistEnv) -> int:
    """Loader workers per rank for --workers -1: its CPUs (cpus_per_rank), at most 8."""
    return min(8, cpus_per_rank(env))


def cpus_per_rank(env: DistEnv) -> int:
    """This rank's share of the CPUs it may run on (Slurm and taskset bind it to some; all where the OS does not say):
    torchrun's ranks share their task's, srun's tasks own theirs. 0 where ranks outnumber the CPUs."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cpus // env.local_world_size if "TORCHELASTIC_RUN_ID" in os.environ else cpus


def host_name() -> str:
    """The node's name: Slurm's when under Slurm (several slurmd may share one test host)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def route_source(ip: str) -> str | None:
    """The local address (so interface) traffic to `ip` leaves from; a UDP connect sends nothing. None: no route."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def master_address() -> str | None:
    """MASTER_ADDR as resolved here: where this rank met the others. None for a single process."""
    try:
        return socket.gethostbyname(os.environ["MASTER_ADDR"]) if "MASTER_ADDR" in os.environ else None
    except OSError:
        return None
