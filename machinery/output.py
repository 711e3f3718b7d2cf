"""Rank 0's output: log() for the whole job, once, not once per rank; say() from a signal handler."""
import os


def is_main_process() -> bool:
    """Rank 0 or the only process, by torchrun's RANK or srun's SLURM_PROCID (before the entry point adopts it)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def log(*args, **kwargs) -> None:
    """print on rank 0 only, flushed; rank 0 is known before the process group, so argparse's errors are said once."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def say(text: str) -> None:
    """log() from a signal handler, where print is not safe: rank 0 writes `text` to stderr."""
    if is_main_process():
        os.write(2, text.encode())


def describe_span(seconds: float) -> str:
    """A duration as people say it: `1 h 31 min`, `12 min`, `40 s`."""
    hours, minutes = divmod(round(seconds / 60), 60)
    return (f"{hours} h {minutes} min" if hours
            else f"{minutes} min" if minutes else f"{max(1, round(seconds))} s")


def report_to_launcher(line: str) -> None:
    """Leave this rank's last line (a refusal, failure, stop) in TORCHELASTIC_ERROR_FILE (per rank, or per job if a
    script sets it), in torch.distributed.elastic's error file format, so torchrun's failure report shows it as the
    root cause's `traceback`, not <N/A>. Nothing without the variable; a file that cannot be written is skipped."""
    import json
    import time
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # whole: several ranks of one job may write the same file
    except OSError:
        pass
