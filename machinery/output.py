"""Rank 0's output: log() for the whole job, once, not once per rank; say() from a signal handler."""
import os


def is_main_process() -> bool:
    """Rank 0 or the only process: torchrun's RANK, or srun's SLURM_PROCID before the entry point adopts it."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def log(*args, **kwargs) -> None:
    """print on rank 0, flushed (known before the process group: argparse's errors are said once)."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def say(text: str) -> None:
    """log() to stderr from a signal handler, where print is not safe."""
    if is_main_process():
        os.write(2, text.encode())


def describe_span(seconds: float) -> str:
    """A duration as people say it: `1 h 31 min`, `12 min`, `40 s`."""
    hours, minutes = divmod(round(seconds / 60), 60)
    return (f"{hours} h {minutes} min" if hours
            else f"{minutes} min" if minutes else f"{max(1, round(seconds))} s")


def report_to_launcher(line: str) -> None:
    """This rank's last line in TORCHELASTIC_ERROR_FILE: torchrun's failure report names it as the root cause."""
    import json
    import time
    from contextlib import suppress
    if not (path := os.environ.get("TORCHELASTIC_ERROR_FILE")):
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.{os.getpid()}.tmp"
    with suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # whole: several ranks of one job may write the same file
