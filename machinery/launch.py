"""Who this process is (torchrun's, srun's or no launcher's env), its device, and how the ranks meet."""
import contextlib
import datetime
import os
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

from machinery.errors import UserError, all_gather, note_host_in_store
from machinery.output import say


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")  # one GPU per process (NCCL); else the CPU (gloo)
    nodes: int = 1  # hosts, counted once the group exists

    is_main = property(lambda self: self.rank == 0)
    cuda = property(lambda self: self.device.type == "cuda")
    distributed = property(lambda self: self.world_size > 1 or dist.is_initialized())


def read_dist_env() -> DistEnv:
    """Ranks from torchrun's env (srun's, once read_launcher adopted it); else one process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                       int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    return DistEnv()


def read_launcher(device: str) -> DistEnv:
    """DistEnv from the launcher's env (srun's read as torchrun's) on `device`: auto, cuda or cpu."""
    # imported later (by the optimizer, the group's threads running), torch._dynamo can abort the exit
    import torch._dynamo  # noqa: F401
    env = os.environ
    if "RANK" not in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:  # `srun python train_ddp.py`
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env["LOCAL_WORLD_SIZE"] = env.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]
        if "MASTER_ADDR" not in env:  # the allocation's first node
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
            try:
                env["MASTER_ADDR"] = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                                    text=True, check=True, timeout=30).stdout.split()[0]
            except (OSError, subprocess.SubprocessError, IndexError):
                env["MASTER_ADDR"] = env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
        # by job id: jobs sharing a node differ
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    found = read_dist_env()
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but PyTorch sees no CUDA GPU; use --device cpu or auto")
    if device != "cpu" and torch.cuda.is_available():
        if found.local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {found.local_rank} has no GPU ({torch.cuda.device_count()} visible): "
                            "launch fewer processes per node")
        found.device = torch.device("cuda", found.local_rank)
    return found


@contextlib.contextmanager
def rendezvous(env: DistEnv, timeout_s: float):
    """Around init_process_group, yielding its other keywords: a failed meeting is one line; ranks note their hosts."""
    store = {}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store across restarts: a fresh namespace per attempt (docs/slurm.md)
        if env.world_size > env.local_world_size and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
            say("warning: torchrun's shared store can hang the nodes on a restart (pytorch/pytorch#135712): "
                "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as jobs/multinode.sh does\n")
        store = {"store": dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/", dist.TCPStore(
                     os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout_s))),
                 "rank": env.rank, "world_size": env.world_size}
    try:
        yield store
    except Exception as e:  # the store's DistStoreError, RuntimeError, TimeoutError
        from machinery.diagnose import refuse_init_failure
        refuse_init_failure(e, env, timeout_s, host=host_name())  # a RendezvousError where it can say why
        raise
    note_host_in_store(env.rank, host_name())


def gather_ranks(env: DistEnv) -> list:
    """A collective: each rank's host, device, route and rendezvous address, by rank (for run.json)."""
    try:  # MASTER_ADDR as this rank resolved it
        master = socket.gethostbyname(os.environ["MASTER_ADDR"])
    except (KeyError, OSError):
        master = None
    return all_gather({"rank": env.rank, "local_rank": env.local_rank, "host": host_name(),
                       "address": route_source(master) if master else None, "master_address": master,
                       "device": torch.cuda.get_device_name(env.device) if env.cuda else "cpu"})


def default_workers(env: DistEnv) -> int:
    return min(8, cpus_per_rank(env))  # --workers -1: the rank's CPUs, at most 8


def cpus_per_rank(env: DistEnv) -> int:
    """This rank's share of its CPUs: torchrun's ranks share their task's, srun's tasks own theirs."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cpus // env.local_world_size if "TORCHELASTIC_RUN_ID" in os.environ else cpus


def host_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # Slurm's: slurmds may share a test host


def route_source(ip: str) -> str | None:
    """The local address (so interface) traffic to `ip` leaves from; a UDP connect sends nothing. None: no route."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None
