"""One-line causes: a hung or lost peer, a failed rendezvous, a test split's classes."""
import datetime
import os
import re
import time

import torch.distributed as dist

from machinery.errors import RendezvousError, joined


def describe_comm_failure(e: Exception, timeout_s: float) -> str | None:
    """One line if `e` is a collective that failed for want of a peer (hung: a timeout; dead: a closed connection)."""
    first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if re.search("timed out|timeout", str(e), re.IGNORECASE):
        collective = isinstance(e, dist.DistBackendError) or any(s in str(e) for s in ("gloo", "NCCL", "Watchdog"))
        absent = ranks_that_did_not_arrive(grace_s=min(30.0, max(5.0, timeout_s / 4))) if collective else None
        who = ", ".join(f"rank {r}" + (f" on {host}" if host else "") for r, host in absent or [])
        why = (f": {who} never reached it (hung, or its node unreachable: kill -USR2 it to see where)" if absent
               else " on every rank: they wait in different collectives, or the network failed" if absent == []
               else ": another rank is hung or dead (kill -USR2 it to see where)")
        return f"a collective operation timed out after {timeout_s:g} s{why}; {first}"
    if any(s in str(e) for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe")):
        return f"lost another rank (its process or node died): {first}; a restart or requeue resumes its checkpoint"
    return None


def ranks_that_did_not_arrive(grace_s: float) -> list | None:
    """[(rank, host)] of the ranks that did not also time out within `grace_s`, by the launcher's store; or None."""
    try:
        store = joined["store"]  # absent: no process group was joined
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store.set_timeout(datetime.timedelta(seconds=5))  # a store that does not answer: no line, not a hang
        store.set(f"timed_out/{rank}", "1")
        deadline = time.monotonic() + grace_s
        while True:
            absent = [r for r in range(world_size) if not store.check([f"timed_out/{r}"])]
            if not absent or time.monotonic() > deadline:
                return [(r, store.get(f"host/{r}").decode() if store.check([f"host/{r}"]) else None)
                        for r in absent]
            time.sleep(0.25)
    except Exception:  # noqa: BLE001 - the store is a help here, not a need
        return None


def refuse_init_failure(e: Exception, env, timeout_s: float, *, host: str) -> None:
    """A RendezvousError's line for a failed init_process_group: a peer at a loopback address, or a timeout."""
    peer = re.search(r"remote=\[([^\]]+)\]", str(e))
    if "connectFullMesh" in str(e) and peer and (peer.group(1).startswith("127.") or peer.group(1) == "::1"):
        ifname = next((f"{v}={os.environ[v]}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                       if os.environ.get(v)), None)
        cause = (f"{ifname} names an interface the other nodes cannot reach: set it to the one with the node's "
                 f"address (ip -br addr), or unset it" if ifname else "the hostname resolves to a loopback "
                 "address: map it to the node's address in /etc/hosts or DNS, or set GLOO_SOCKET_IFNAME")
        raise RendezvousError(f"rank {env.rank} on {host} cannot connect to another rank at {peer.group(1)}, a "
                              f"loopback address, so ranks on different nodes cannot meet: {cause}") from None
    if re.search("timed out|timeout", str(e), re.IGNORECASE):
        raise RendezvousError(f"rank {env.rank} timed out after {timeout_s:g} s in init_process_group waiting for all "
                              f"{env.world_size} ranks at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: "
                              "check that every node started and reaches that address, or raise --timeout") from None


def describe_class_mismatch(index: dict, test_index: dict, source: str) -> str:
    """The line for a test split whose classes (name -> index) are not `source`'s."""
    def listed(classes):  # "" for none
        return ", ".join(map(repr, classes[:3])) + (f" and {len(classes) - 3} more" if len(classes) > 3 else "")
    lacks = listed([c for c in index if c not in test_index])
    extra = listed([c for c in test_index if c not in index])
    what = " and ".join(filter(None, [lacks and f"lacks {lacks}", extra and f"has {extra}, which {source} lacks"]))
    what = what or "numbers the same classes otherwise"
    fix = ("rename or remove the test split's class folders that training lacks" if extra and not lacks else
           "fix the names, or number the test split by training's: dataset_utils.image_folder(path, classes=...)")
    return f"the test split's classes are not {source}'s: it {what}, so its labels would name other classes; {fix}"
