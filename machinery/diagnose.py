"""One line for what went wrong where a traceback would say it badly: a collective that timed out or lost a
peer (describe_comm_failure, naming the ranks that never came), a rendezvous that failed
(describe_init_failure), a mistyped flag (refuse_flags), test classes numbered otherwise. Imported only when it
happens."""
import datetime
import difflib
import os
import re
import sys
import time

import torch.distributed as dist

from machinery.errors import joined
from machinery.output import is_main_process


def is_timeout(e: Exception) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def describe_comm_failure(e: Exception, timeout_s: float) -> str | None:
    """A one-line explanation if `e` is a collective that failed for want of a peer (hung: a
    timeout, with the ranks that never arrived where the store can tell; dead: its connection
    closed), else None."""
    first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if is_timeout(e):
        collective = (isinstance(e, dist.DistBackendError)
                      or any(s in str(e) for s in ("gloo", "NCCL", "Watchdog")))
        absent = ranks_that_did_not_arrive(grace_s=min(30.0, max(5.0, timeout_s / 4))) if collective else None
        if absent:
            who = ", ".join(f"rank {r}" + (f" on {host}" if host else "") for r, host in absent)
            return (f"a collective operation timed out after {timeout_s:g} s: {who} never reached it (hung, "
                    f"or its node is unreachable: send its process SIGUSR2 to see where it is stuck); "
                    f"{first}")
        if absent == []:
            return (f"a collective operation timed out after {timeout_s:g} s on every rank: they wait in "
                    f"different collectives (a rank took another path through the code), or the network "
                    f"between them failed; {first}")
        return (f"a collective operation timed out after {timeout_s:g} s: another rank is hung or dead "
                f"(send it SIGUSR2 to see where it is stuck); {first}")
    if any(s in str(e) for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe")):
        return (f"lost another rank (its process or node died): {first}; the last checkpoint is intact, "
                f"and torchrun --max-restarts (or a requeue) resumes from it")
    return None


def ranks_that_did_not_arrive(grace_s: float) -> list | None:
    """After a collective timed out on this rank: say so in the process group's store (the launcher's, which
    outlives a hung rank), wait up to `grace_s` for the other ranks that wait in a collective to time out
    and say so too, and return [(rank, host)] of those that never did: the ones that are hung elsewhere,
    or gone. None if the store cannot tell (no process group was joined, or its server is gone)."""
    store = joined.get("store")
    if store is None:
        return None
    try:
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


def describe_init_failure(e: Exception, env, timeout_s: float, *, host: str) -> str | None:
    """One line for an init_process_group that failed, else None: a peer advertised a loopback address
    (gloo's connect to it is refused within seconds: ranks bound to an interface that other nodes cannot
    reach), or the rendezvous timed out."""
    text = str(e)
    peer = re.search(r"remote=\[([^\]]+)\]", text)
    if "connectFullMesh" in text and peer and (peer.group(1).startswith("127.") or peer.group(1) == "::1"):
        ifname = next((f"{v}={os.environ[v]}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                       if os.environ.get(v)), None)
        cause = (f"{ifname} names an interface the other nodes cannot reach: set it to the interface that "
                 f"carries the node's address (ip -br addr), or unset it" if ifname else
                 "the hostname resolves to a loopback address: map it to the node's address in /etc/hosts or "
                 "DNS, or set GLOO_SOCKET_IFNAME to the interface that carries that address")
        return (f"rank {env.rank} on {host} cannot connect to another rank at {peer.group(1)}, a "
                f"loopback address, so ranks on different nodes cannot meet: {cause}")
    if is_timeout(e):
        return (f"rank {env.rank} timed out after {timeout_s:g} s in init_process_group waiting for all "
                f"{env.world_size} ranks at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}: "
                f"check that every node started and can reach that address, or raise --timeout")
    return None


def refuse_flags(parser, message: str):
    """argparse's error, in this script's form: one `error:` line from rank 0 (every rank parses the
    same command line and leaves with it), naming the flags a mistyped one may have meant; exit status 2.
    Unknown flags read `unknown flag --batchsize; did you mean --batch-size?`; other errors keep argparse's
    words."""
    # The long flags the usage line names (argparse keeps its list private), and --help, which it names -h.
    known = re.findall(r"(?<![\w-])--\w[\w-]*", parser.format_usage()) + ["--help"] * parser.add_help
    _, found, extra = message.partition("unrecognized arguments:")
    extra = extra.split() if found else []
    unknown = list(dict.fromkeys(f for f in (a.split("=", 1)[0] for a in extra if a.startswith("--"))
                                 if f not in known))
    if unknown:
        guesses = {flag: guess_flags(flag, known) for flag in unknown}
        if len(unknown) == 1:
            hints = f"; did you mean {guesses[unknown[0]]}?" if guesses[unknown[0]] else ""
        else:
            hints = "".join(f"; {flag}: did you mean {said}?" for flag, said in guesses.items() if said)
        message = f"unknown flag{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}{hints}"
    if is_main_process():
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
    sys.exit(2)


def guess_flags(flag: str, known: list) -> str:
    """The flags a mistyped `flag` may have meant, as `--batch-size` or `--base-lr, --lr-scaling or
    --lr-schedule`: those spelled alike (--batchsize, --epoch), or holding its word (--lr); "" if none."""
    word = flag[2:].replace("_", "-")
    alike = difflib.get_close_matches("--" + word, known, n=3, cutoff=0.75)
    names = alike + [o for o in known if word in o[2:].split("-") and o not in alike][:3 - len(alike)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}" if names else ""


def describe_class_mismatch(index: dict, test_index: dict, source: str) -> str:
    """The line for a test split whose classes (name -> index) are not `source`'s (data_checks.check_same_classes)."""
    lacks, extra = [c for c in index if c not in test_index], [c for c in test_index if c not in index]

    def listed(classes):
        return ", ".join(map(repr, classes[:3])) + (f" and {len(classes) - 3} more" if len(classes) > 3
                                                    else "")
    found = [f"lacks {listed(lacks)}"] if lacks else []
    found += [f"has {listed(extra)}, which {source} lacks"] if extra else []
    what = " and ".join(found) if found else "numbers the same classes otherwise"
    fix = ("rename or remove the test split's class folders that training lacks" if extra and not lacks else
           "fix the folder names, or number the test split by the training classes: "
           "dataset_utils.image_folder(path, classes=...) (README, Adapt it)")
    return (f"the test split's classes are not {source}'s: it {what}, so its labels would name other "
            f"classes (ImageFolder numbers the class folders it finds); {fix}")
