"""Preflight: check, on every rank, what a long job needs, before it queues for hours.

    torchrun --standalone --nproc_per_node=4 preflight.py --data-dir ./datasets --out-dir ./runs/wrn
    sbatch jobs/preflight.sh                        # the same, through Slurm, on the nodes you will use

It launches like train_ddp.py and reports: which GPU each rank drives (unique per node), the
backend and library versions, whether the data and the out-dir are usable on every node, the
all-reduce bandwidth (with a warning when it looks like a socket fallback), and NCCL hints from
the GPU topology. It exits 1 if a check fails, so a job script can stop before training.
"""
import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import dataset_utils as du
from train_utils import (UserError, all_gather, check_writable, host_name, init_distributed, log, pick_device,
                         read_dist_env)


def get_args_parser():
    p = argparse.ArgumentParser(description="Check GPUs, data, out-dir and interconnect on every rank.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100", help="as in train_ddp.py")
    p.add_argument("--data-dir", default="./datasets", help="as in train_ddp.py")
    p.add_argument("--out-dir", default="./runs/wrn", help="as in train_ddp.py")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="as in train_ddp.py")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a hung rendezvous or collective fails")
    p.add_argument("--max-mib", type=int, default=256, help="largest all-reduce message for the bandwidth test")
    return p


def check_data(dataset: str, data_dir: str) -> str | None:
    """None if this node can read the data, else what is wrong (without downloading anything)."""
    if dataset == "synthetic":
        return None
    folder = os.path.join(data_dir, du.CIFAR100_FOLDER)
    if all(os.access(os.path.join(folder, f), os.R_OK) for f in ("train", "test", "meta")):
        return None
    archive = os.path.join(data_dir, du.CIFAR100_ARCHIVE)
    if os.access(archive, os.R_OK):
        return None  # train_ddp.py verifies its md5 and extracts it
    return f"neither {folder}/ nor {archive} is readable here"


def bus_bandwidth(device, max_mib: int) -> list:
    """all_reduce bus bandwidth (GB/s, as nccl-tests reports it) for growing message sizes."""
    n = dist.get_world_size()
    results, mib = [], 1
    while mib <= max_mib:
        x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        iters = 5 if device.type == "cuda" else 2
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - t) / iters
        results.append((mib, x.numel() * 4 * 2 * (n - 1) / n / seconds / 1e9))
        mib *= 4
    return results


def topology_hints() -> list:
    """NCCL hints from `nvidia-smi topo -m`: GPU pairs that only meet across CPU sockets (SYS)."""
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpu_rows = [line.split() for line in topo.splitlines() if line.startswith("GPU")]
    if any("SYS" in row[1:len(gpu_rows) + 1] for row in gpu_rows):
        return ["some GPU pairs meet only across CPU sockets (SYS in nvidia-smi topo -m): if training hangs at "
                "the first all-reduce, set NCCL_P2P_DISABLE=1 (DAIC needs it)"]
    return []


def pci_address(device) -> str:
    """The GPU's PCI address as nvidia-smi prints it (domain:bus:device): unique on the node, where the
    bus number alone is not (machines with one PCI domain per GPU put every GPU on bus 0)."""
    p = torch.cuda.get_device_properties(device)
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}"


def main(args) -> int:
    env = read_dist_env()
    env.device = device = pick_device(args.device, env.local_rank)
    init_distributed(env, args.timeout)
    try:
        me = {"rank": env.rank, "local_rank": env.local_rank, "host": host_name(), "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "-",
              "bus_id": pci_address(device) if device.type == "cuda" else "-",
              "data": check_data(args.dataset, args.data_dir), "out_dir": None, "hints": topology_hints()}
        try:
            check_writable(args.out_dir)
        except UserError as e:
            me["out_dir"] = str(e)
        ranks = all_gather(me)
        backend = dist.get_backend() if dist.is_initialized() else "none (one process)"
        log(f"backend {backend}; torch {torch.__version__}; CUDA {torch.version.cuda}; "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}; "
            f"cuDNN {torch.backends.cudnn.version() if torch.cuda.is_available() else '-'}; world size {env.world_size}")
        log(f"{'rank':>4} {'local':>5} {'host':<16} {'device':<8} {'gpu':<28} {'pci address':<14} data / out-dir")
        for r in ranks:
            status = "ok" if not (r["data"] or r["out_dir"]) else "; ".join(x for x in (r["data"], r["out_dir"]) if x)
            log(f"{r['rank']:>4} {r['local_rank']:>5} {r['host']:<16} {r['device']:<8} {r['gpu'][:28]:<28} "
                f"{r['bus_id']:<14} {status}")
        problems = [f"rank {r['rank']} on {r['host']}: {x}" for r in ranks for x in (r["data"], r["out_dir"]) if x]
        seen = {}
        for r in ranks:
            if r["device"] != "cpu":
                key = (r["host"], r["bus_id"] if r["bus_id"] != "-" else r["device"])
                if key in seen:
                    problems.append(f"ranks {seen[key]} and {r['rank']} share {key[1]} on {key[0]}: "
                                    f"launch one process per GPU, with LOCAL_RANK picking the GPU")
                seen[key] = r["rank"]
        if env.world_size > 1:
            bw = bus_bandwidth(device, args.max_mib if device.type == "cuda" else min(args.max_mib, 16))
            log("all_reduce bus bandwidth: " + ", ".join(f"{mib} MiB {gbs:.2f} GB/s" for mib, gbs in bw))
            best = max(gbs for _, gbs in bw)
            nodes = len({r["host"] for r in ranks})
            if device.type == "cuda" and nodes > 1 and best < 5:
                log(f"warning: {best:.1f} GB/s between nodes looks like TCP sockets, not InfiniBand/RoCE: check "
                    f"NCCL_DEBUG=INFO for 'NET/Socket', and NCCL_IB_HCA / NCCL_SOCKET_IFNAME")
            elif device.type == "cuda" and nodes == 1 and best < 20:
                log(f"warning: {best:.1f} GB/s within one node suggests no NVLink/P2P: check nvidia-smi topo -m "
                    f"and whether NCCL_P2P_DISABLE is set")
        for hint in sorted({h for r in ranks for h in r["hints"]}):
            log(f"hint: {hint}")
        nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        log(f"NCCL settings: {nccl_env or 'none'}")
        if problems:
            for p in problems:
                log(f"FAILED: {p}", file=sys.stderr)
            return 1
        log("preflight: all checks passed")
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        sys.exit(main(get_args_parser().parse_args()))
    except UserError as e:
        log(f"error: {e}", file=sys.stderr)
        sys.exit(2)
