"""Preflight: check, on every rank, what a long job needs, before it queues for hours.

    torchrun --standalone --nproc_per_node=4 preflight.py --data-dir ./datasets --out-dir ./runs/wrn
    sbatch jobs/preflight.sh                        # the same, through Slurm, on the nodes you will use

It launches like train_ddp.py and reports: which GPU each rank drives (unique per node), the
backend and library versions, whether the data and the out-dir are usable on every node, the
all-reduce bandwidth (with a warning when it looks like a socket fallback), and NCCL hints from
the GPU topology. It exits 1 if a check fails, so a job script can stop before training. SIGTERM and Ctrl-C
stop it at once: one line on stderr, exit status 128 + the signal's number (143, 130).

    srun --ntasks-per-node=1 python preflight.py --network node1:29500    # what jobs/preflight.sh runs first

checks the network before any rank starts, one task per node (under srun, without torchrun): that
each node reaches the rendezvous address (the first node listens there), and that the interface
named in NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME exists and can reach the other nodes. A failure
there names its cause at once, where torchrun or the ranks would wait for their timeout.
"""
import argparse
import fcntl
import ipaddress
import json
import os
import socket
import struct
import subprocess
import sys
import time


import torch
import torch.distributed as dist

from machinery import cifar_archive
from machinery.errors import RendezvousError, UserError, all_gather
from machinery.files import check_writable
from machinery.launch import host_name, read_dist_env, route_source
from machinery.output import log
from tools.tool_exit import run_tool
from train_ddp import init_distributed


def get_args_parser():
    p = argparse.ArgumentParser(description="Check GPUs, data, out-dir and interconnect on every rank.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100",
                   help="as in train_ddp.py")
    p.add_argument("--data-dir", default="./datasets", help="as in train_ddp.py")
    p.add_argument("--out-dir", default="./runs/wrn", help="as in train_ddp.py")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="as in train_ddp.py")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds before a hung rendezvous or collective fails")
    p.add_argument("--max-mib", type=int, default=256,
                   help="largest all-reduce message for the bandwidth test")
    p.add_argument("--bench", metavar="JSON",
                   help="a bench.py --comm-hooks result: predict the scaling efficiency at this job's size with "
                        "each --comm-hook, from its step time and bytes and the bandwidth measured here")
    p.add_argument("--network", metavar="HOST:PORT",
                   help="only check the network, one process per node under srun: every node reaches "
                        "HOST:PORT (the rendezvous; the first node listens there) and the interface that "
                        "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME names")
    return p


def check_data(dataset: str, data_dir: str) -> str | None:
    """None if this node can read the data, else what is wrong (without downloading anything)."""
    if dataset == "synthetic":
        return None
    folder = os.path.join(data_dir, cifar_archive.CIFAR100_FOLDER)
    if all(os.access(os.path.join(folder, f), os.R_OK) for f in ("train", "test", "meta")):
        return None
    archive = os.path.join(data_dir, cifar_archive.CIFAR100_ARCHIVE)
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


def read_comm_bench(path: str) -> dict:
    """bench.py --comm-hooks' result in `path` (its "comm_hooks"), or UserError naming how to make one."""
    try:
        with open(path) as f:
            return json.load(f)["comm_hooks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = "it holds no comm_hooks result" if isinstance(e, (KeyError, TypeError)) else str(e).splitlines()[0]
        raise UserError(f"--bench {path}: {why}; make one with torchrun --nproc_per_node=2 bench.py --comm-hooks "
                        f"--json {path} (on the job's GPUs, with its per-GPU batch)") from None


def predict_scaling(bench: dict, bus_gbs: float, world_size: int, *, mib: int) -> list:
    """Lines predicting the scaling efficiency at `world_size` ranks with each hook: the all-reduce of the bytes the
    hook sends per step (bench.py --comm-hooks) at `bus_gbs` (nccl-tests' bus bandwidth, measured with `mib` MiB
    messages: a ring sends 2(N-1)/N of the bytes), against the step's time without an all-reduce. Between two
    bounds: DDP hides none of it behind backward, or all of it."""
    compute, lines = bench["compute_s"], []
    lines.append(f"predicted scaling at {world_size} ranks: a step of {compute * 1e3:.2f} ms without all-reduce "
                 f"(bench.py --comm-hooks on {bench['world_size']} ranks), all-reduced at {bus_gbs:.2f} GB/s (the "
                 f"{mib} MiB messages'); efficiency if backward hides none of it - all of it:")
    for hook, row in bench["rows"].items():
        comm = row["bytes_per_step"] * 2 * (world_size - 1) / world_size / (bus_gbs * 1e9)
        lines.append(f"  --comm-hook {hook}: {row['bytes_per_step'] / 2**20:.2f} MiB per step, all-reduce "
                     f"{comm * 1e3:.2f} ms: {compute / (compute + comm):.0%} - {compute / max(compute, comm):.0%}")
    return lines


def topology_hints() -> list:
    """NCCL hints from `nvidia-smi topo -m`: GPU pairs that only meet across CPU sockets (SYS)."""
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpu_rows = [line.split() for line in topo.splitlines() if line.startswith("GPU")]
    if any("SYS" in row[1:len(gpu_rows) + 1] for row in gpu_rows):
        return ["some GPU pairs meet only across CPU sockets (SYS in nvidia-smi topo -m): if training hangs "
                "at the first all-reduce, set NCCL_P2P_DISABLE=1 (DAIC needs it)"]
    return []


def pci_address(device) -> str:
    """The GPU's PCI address as nvidia-smi prints it (domain:bus:device): unique on the node, where the
    bus number alone is not (machines with one PCI domain per GPU put every GPU on bus 0)."""
    p = torch.cuda.get_device_properties(device)
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}"


# ----------------------------------------------------------------------------- network (--network)

SIOCGIFFLAGS, SIOCGIFADDR, IFF_LOOPBACK = 0x8913, 0x8915, 0x8


def interfaces() -> dict:
    """This node's network interfaces: {name: (is loopback, IPv4 address or None)}. Asked of the
    kernel (ioctl), which answers for the network namespace this process runs in."""
    result = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("16sH14s", name.encode()[:15], 0, b"")
            try:
                flags = struct.unpack("16sH", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)[:18])[1]
            except OSError:
                continue
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
            except OSError:
                addr = None  # no IPv4 address
            result[name] = (bool(flags & IFF_LOOPBACK), addr)
    return result


def check_interfaces(nodes: int, host: str, master_ip: str | None) -> list:
    """What is wrong with NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME on this node, if set."""
    have = interfaces()
    src = route_source(master_ip) if master_ip else None
    right = next((f"{n} {a}" for n, (lo, a) in have.items() if a and a == src and not lo), None)
    fix = (f"the interface that holds this node's address ({right})" if right
           else "an interface the other nodes reach")
    problems = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = os.environ.get(var)
        if not value:
            continue
        if var == "NCCL_SOCKET_IFNAME" and value.startswith("^"):
            wanted = [n for n in have if not any(n.startswith(x) for x in value[1:].split(","))]
        elif var == "NCCL_SOCKET_IFNAME" and not value.startswith("="):  # NCCL matches prefixes
            wanted = [n for n in have if any(n.startswith(x) for x in value.split(","))]
        else:
            wanted = [n for n in have if n in value.lstrip("=").split(",")]
        if not wanted:
            problems.append(f"{var}={value} names no interface on {host} (it has {', '.join(sorted(have))}): "
                            f"set it to {fix}, or unset it")
        elif nodes > 1 and all(have[n][0] for n in wanted):
            problems.append(f"{var}={value} is the loopback interface, which the other nodes cannot reach: "
                            f"ranks on different nodes could not connect to each other; set it to {fix}, or "
                            f"unset it")
    return problems


def check_network(args, env=os.environ) -> int:
    """One process per node (srun --ntasks-per-node=1): the first node listens on the rendezvous
    port, every other node connects to the rendezvous address. Each reports what it found."""
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    node, nodes = (int(env.get("SLURM_NODEID", 0)),
                   int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", 1))))
    name, _, port = args.network.rpartition(":")
    name, port = name.strip("[]"), int(port)
    problems = []
    try:
        master_ip = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)[0][4][0]
        shown = f"{name}:{port} ({master_ip} from {host})" if master_ip != name else f"{name}:{port}"
    except socket.gaierror as e:
        master_ip, shown = None, f"{name}:{port}"
        problems.append(f"cannot resolve the rendezvous host {name} on {host} ({e.strerror}): check "
                        f"/etc/hosts or DNS there")
    problems += check_interfaces(nodes, host, master_ip)
    if nodes > 1 and node == 0:
        problems += listen_for_nodes(port, nodes - 1, args.timeout, shown)
    elif nodes > 1 and master_ip:
        if ipaddress.ip_address(master_ip).is_loopback:
            problems.append(f"the rendezvous host {name} resolves to {master_ip} on {host}, a loopback "
                            f"address: this node would wait for itself; fix /etc/hosts or DNS on {host}")
        else:
            problems += reach_master(master_ip, port, host, args.timeout, shown)
    for p in problems:
        print(f"FAILED: network on {host}: {p}", file=sys.stderr, flush=True)
    if not problems:
        print(f"network on {host}: ok, rendezvous {shown}"
              f"{f', reached by the {nodes - 1} other node(s)' if nodes > 1 and node == 0 else ''}",
              flush=True)
    return 1 if problems else 0


def listen_for_nodes(port: int, expected: int, timeout: float, shown: str) -> list:
    """On the first node: accept `expected` other nodes on the rendezvous port, as torchrun will."""
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    try:
        server = socket.create_server(("", port), family=family, dualstack_ipv6=family == socket.AF_INET6)
    except OSError as e:
        return [f"cannot listen on the rendezvous port {port} ({e.strerror}): another job or process "
                f"holds it"]
    seen, deadline = [], time.monotonic() + timeout
    with server:
        while len(seen) < expected and (left := deadline - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            with conn:
                conn.settimeout(5)
                try:
                    seen.append(conn.recv(256).decode(errors="replace").strip())
                    conn.sendall(b"ok\n")  # the client closes first, so the port is free for torchrun at once
                    conn.recv(1)
                except OSError:
                    pass
    if len(seen) < expected:
        return [f"{expected - len(seen)} of {expected} other node(s) did not reach the rendezvous {shown} "
                f"within {timeout:g} s (reached: {', '.join(seen) or 'none'}): see their own lines"]
    return []


def reach_master(ip: str, port: int, host: str, timeout: float, shown: str) -> list:
    """On the other nodes: connect to the rendezvous, retrying until `timeout` (the first node may
    start listening a little later)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((ip, port),
                                          timeout=max(0.1, min(5.0, deadline - time.monotonic()))) as c:
                c.sendall(host.encode() + b"\n")
                c.settimeout(5)
                if c.recv(16).startswith(b"ok"):
                    return []
                last = "it answered, but not as the first node of this job"
        except OSError as e:
            last = e.strerror or type(e).__name__
        time.sleep(0.5)
    return [f"the rendezvous {shown} did not answer within {timeout:g} s ({last}): the ranks would wait for "
            f"it until --timeout; check that the first node's name resolves to an address this node reaches "
            f"(getent hosts, /etc/hosts, DNS) and that no firewall drops the port"]


def main(args) -> int:
    if args.network:
        return check_network(args)
    bench = read_comm_bench(args.bench) if args.bench else None  # bad input: one line, before any work
    try:
        env = init_distributed(args.device, args.timeout)
        device = env.device
    # every rank says why: there is no process group to gather it
    except (RendezvousError, RuntimeError) as e:
        env = read_dist_env()  # as init_distributed read it (srun's variables adopted)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        try:
            master_ip = socket.getaddrinfo(os.environ.get("MASTER_ADDR", ""), None)[0][4][0]
        except (socket.gaierror, UnicodeError):
            master_ip = None
        causes = check_interfaces(env.world_size // max(env.local_world_size, 1), host_name(), master_ip)
        print(f"FAILED: rank {env.rank} on {host_name()}: rendezvous: {why}"
              + "".join(f"; {c}" for c in causes), file=sys.stderr, flush=True)
        return 1
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
            f"cuDNN {torch.backends.cudnn.version() if torch.cuda.is_available() else '-'}; "
            f"world size {env.world_size}")
        log(f"{'rank':>4} {'local':>5} {'host':<16} {'device':<8} {'gpu':<28} {'pci address':<14} "
            f"data / out-dir")
        for r in ranks:
            status = ("ok" if not (r["data"] or r["out_dir"])
                      else "; ".join(x for x in (r["data"], r["out_dir"]) if x))
            log(f"{r['rank']:>4} {r['local_rank']:>5} {r['host']:<16} {r['device']:<8} {r['gpu'][:28]:<28} "
                f"{r['bus_id']:<14} {status}")
        problems = [f"rank {r['rank']} on {r['host']}: {x}"
                    for r in ranks for x in (r["data"], r["out_dir"]) if x]
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
            bucket_mib, bucket_gbs = min(bw, key=lambda point: abs(point[0] - 25))  # DDP's buckets: 25 MiB
            for line in predict_scaling(bench, bucket_gbs, env.world_size, mib=bucket_mib) if bench else ():
                log(line)
            nodes = len({r["host"] for r in ranks})
            if device.type == "cuda" and nodes > 1 and best < 5:
                log(f"warning: {best:.1f} GB/s between nodes looks like TCP sockets, not InfiniBand/RoCE: "
                    f"check NCCL_DEBUG=INFO for 'NET/Socket', and NCCL_IB_HCA / NCCL_SOCKET_IFNAME")
            elif device.type == "cuda" and nodes == 1 and best < 20:
                log(f"warning: {best:.1f} GB/s within one node suggests no NVLink/P2P: check "
                    f"nvidia-smi topo -m and whether NCCL_P2P_DISABLE is set")
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
    # SIGTERM and Ctrl-C: out at once in one line; bad input: one line
    sys.exit(run_tool(main, get_args_parser()))
