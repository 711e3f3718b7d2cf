"""What a launcher leaves a rank to sort out: srun's variables adopted as torchrun's (adopt_slurm_env), and a fresh
rendezvous store per torchrun restart (restart_store). Imported when that launcher started the process
(machinery/launch.py)."""
import datetime
import os
import sys

import torch.distributed as dist


def adopt_slurm_env() -> None:
    """Write an srun step's variables into os.environ as torchrun's, for init_process_group("env://"). The master is
    the allocation's first node; the port comes from the job id, so two jobs sharing a node do not collide."""
    env = os.environ
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = env.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]
    if "MASTER_ADDR" not in env:
        import subprocess
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                                 check=True, timeout=30).stdout.split()
            env["MASTER_ADDR"] = out[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["MASTER_ADDR"] = env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def restart_store(env, timeout_s: float) -> dict:
    """init_process_group's store under a torchrun restart: a fresh namespace of torchrun's store per attempt, with
    this rank and the world size. torchrun keeps one store across --max-restarts, so restarted ranks would read the
    dead ranks' gloo addresses (or NCCL id) and wait forever. The count is per agent, so exact on one node only; with
    several, torchrun must not share its store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the warning says)."""
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if env.is_main and env.world_size > env.local_world_size and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
        print("warning: torchrun shares its rendezvous store with the ranks, so a restart or a node "
              "joining can hang the other nodes (pytorch/pytorch#135712); export "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun, as jobs/multinode.sh does",
              file=sys.stderr, flush=True)
    return {"store": dist.PrefixStore(f"attempt_{restart}/", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s))),
            "rank": env.rank, "world_size": env.world_size}
