"""What bench.py --loader-check measures with: the run's training loader read without training (read_rate), the
file system the data sit on, and the verdict (judge) with the fixes that fit this run (name_fixes). bench.py times
the step the loader feeds."""
import os
import re

from machinery.errors import UserError
from machinery.timing import Clock

# The loader keeps up when the step would wait for it at most this share of its time.
KEEPS_UP_WAIT = 0.05
# File systems every node reads over the network (/proc/mounts' names): many small files there are slow to open,
# and load the servers that every user's job shares.
SHARED_FILE_SYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "fuse.ceph-fuse",
                       "fuse.sshfs", "panfs", "wekafs", "glusterfs", "fuse.glusterfs", "pvfs2", "orangefs"}


def read_rate(loader, device, *, warmup: int, batches: int) -> dict:
    """The training loader's batches (micro-batches, with accumulation) copied to the device, as train_step takes
    them, and nothing else: `warmup` untimed (the workers' start), then up to `batches` timed, in epoch 1; every rank
    stops at the same batch, whatever unreadable samples it skipped. Returns the images timed, their seconds and the
    shape the model gets."""
    clock, images, seen, shape = Clock(device), 0, 0, None
    start = clock.mark() if warmup == 0 else None
    loader.batch_sampler.set_epoch(1)
    for batch, labels in loader:
        batch, _ = batch.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        shape, seen = tuple(batch.shape[1:]), seen + 1
        if seen == warmup:  # the clock starts before the first timed batch is asked for
            start = clock.mark()
        elif seen > warmup:
            images += len(batch)
            if seen == warmup + batches:
                break
    if images == 0:
        raise UserError(f"an epoch holds {seen} batches per rank, all taken by --warmup: give a smaller --warmup, "
                        f"so that some are timed")
    return {"images": images, "seconds": clock.seconds(start, clock.mark()), "shape": shape}


def file_system(path: str) -> str:
    """The type of the file system holding `path` (/proc/mounts' longest mount point above it), or "unknown"."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return kind
    for point, fs in mounts:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)  # \040: a space, ...
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fs
    return kind


def judge(*, read_per_rank: list, step_s: float, per_rank_batch: int, overlapped: bool) -> dict:
    """Does the loader keep up? Its slowest rank (which every step waits for) against the step's own time. With
    workers (`overlapped`) a batch is read while the step before it runs, so a step waits only for the time by which
    reading exceeds it; the device loader and --workers 0 read in the step, so their time always adds."""
    load_s = per_rank_batch / min(read_per_rank)
    wait = max(0.0, load_s - step_s) / max(load_s, step_s) if overlapped else load_s / (load_s + step_s)
    return {"ratio": step_s / load_s, "wait_share": wait, "keeps_up": wait <= KEEPS_UP_WAIT, "overlapped": overlapped}


def say_verdict(verdict: dict, fixes: list) -> str:
    """judge's verdict in one line, with the fixes when the loader falls short."""
    if verdict["overlapped"]:
        said = (f"the slowest rank's loader delivers {verdict['ratio']:.2f}x what its step consumes" +
                ("" if verdict["keeps_up"] else
                 f", so each step would wait for data {verdict['wait_share'] * 100:.0f}% of its time"))
    else:
        said = (f"it reads within the step (no DataLoader workers read ahead), which would spend "
                f"{verdict['wait_share'] * 100:.0f}% of its time on data (the loader delivers {verdict['ratio']:.2f}x "
                f"what the step alone consumes)")
    if verdict["keeps_up"]:
        return f"loader check: it keeps up: {said}"
    return f"loader check: it falls short: {said}; the fixes: {'; '.join(fixes)}"


def name_fixes(*, device_loader: bool, workers: int, cpus: int, in_memory: bool, data_dir: str, fs: str) -> list:
    """The ways out of a loader that falls short, for this run, likeliest first."""
    if device_loader:  # its batches are made within the step: the default crop and flip batched, another one per image
        return [f"--loader torch with --workers up to {cpus} (DataLoader workers make the batches beside the step; "
                f"the device loader makes them within it, one image at a time for a transform other than the "
                f"default crop and flip)"]
    has = f"each rank here has {cpus} CPU{'s' if cpus > 1 else ''}"
    fixes = [f"more --workers ({workers} now; {has})" if workers < cpus else
             f"more CPUs per rank (its {workers} worker{'s' if workers > 1 else ''} already have the CPUs: {has}; "
             f"#SBATCH --cpus-per-task)"]
    if in_memory:
        fixes.append("--loader gpu (the data are in memory: the GPU crops and flips them in batches)")
    else:
        if fs in SHARED_FILE_SYSTEMS:
            fixes.append(f"the data on each node's local disk (STAGE_DATA, jobs/README.md: {data_dir} is on {fs}, "
                         f"read over the network)")
        fixes.append("load_data returning ImageData with --loader gpu, if the data fit in memory (docs/adapt.md)")
    return fixes
