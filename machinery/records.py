"""The run's files (config.json, metrics.jsonl, run.json, summary.json, TensorBoard, eval.json) and summary lines."""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import asdict

import torch

from machinery.files import now_iso, write_json, write_on_main, write_text
from machinery.launch import DistEnv, gather_ranks
from machinery.output import describe_span, log


def describe_run_eta(done: int, epochs: int, seconds_per_epoch: float) -> str:
    """`Run: 3 of 100 epochs done; about 1 h 31 min left (ends about 14:05) at this session's pace`."""
    left_s = (epochs - done) * seconds_per_epoch
    span = describe_span(left_s)
    ends = datetime.datetime.now() + datetime.timedelta(seconds=left_s)
    when = ends.strftime("%H:%M" if left_s < 20 * 3600 else "%a %H:%M")
    return (f"Run: {done} of {epochs} epochs done; about {span} left (ends about {when}) at this session's "
            f"pace")


class RunFiles:
    """The run's files, written by rank 0 and agreed on by all ranks (write_on_main: a failed write ends every rank
    with one line). metrics.jsonl is rewritten whole from the checkpoint's history at each start and epoch: never a
    partial line or an epoch that trains again. Made by every rank (it gathers hosts and devices for run.json)."""

    def __init__(self, cfg, env: DistEnv, data, *, history: list, lock):
        from machinery.data_names import records_name  # "dataset": the data as the Data line names them
        config = {**cfg.to_dict(), "dataset": records_name(cfg.dataset, cfg.data_dir, data.source),
                  "data": data.source, "data_spec": asdict(data.spec)}
        self.cfg, self.env, self.config, self.lock = cfg, env, config, lock
        self.ranks = gather_ranks(env)
        self.n_train, self.n_test = len(data.train), len(data.test)
        self.top5 = data.spec.num_classes > 5  # top-5 is always 1 with 5 classes or fewer
        self.metrics_path = os.path.join(self.cfg.out_dir, "metrics.jsonl")
        self.rows = [json.dumps(m) + "\n" for m in history]
        self.record, self.tensorboard = provenance(config, self.ranks) if env.is_main else None, None
        self.started, self.epochs_here = time.perf_counter(), 0  # this session's pace, for the run's ETA

        def write_start():
            write_json(os.path.join(self.cfg.out_dir, "config.json"), config)
            write_text(self.metrics_path, "".join(self.rows))
            write_json(os.path.join(self.cfg.out_dir, "run.json"), self.record)
            if self.cfg.tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # optional; check_args made sure it imports
                self.tensorboard = SummaryWriter(os.path.join(self.cfg.out_dir, "tensorboard"))
        self._write(write_start, "the run's records (config.json, metrics.jsonl, run.json)")

    def _write(self, write, what: str) -> None:
        write_on_main(self.env, write, what=what, out_dir=self.cfg.out_dir, lock=self.lock)

    def add_epoch(self, metrics: dict) -> None:
        """An epoch's lines (the original script's four, and what applies: log_epoch), its row of metrics.jsonl
        (and TensorBoard's), then the run's ETA."""
        log_epoch(metrics, self.cfg.epochs, top5=self.top5)
        self.rows.append(json.dumps(metrics) + "\n")

        def write_epoch():
            write_text(self.metrics_path, "".join(self.rows))  # whole, atomically: never a partial last line
            if self.tensorboard:
                for key, value in metrics.items():
                    # not rank_times' list, slow_rank's line, nor a mark (includes_start_up)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        self.tensorboard.add_scalar(key, value, metrics["epoch"])
                self.tensorboard.flush()  # a preempted run keeps its curves too
        self._write(write_epoch, f"epoch {metrics['epoch']}'s metrics")
        self.epochs_here += 1
        if metrics["epoch"] < self.cfg.epochs:
            log(describe_run_eta(metrics["epoch"], self.cfg.epochs,
                                 (time.perf_counter() - self.started) / self.epochs_here))

    def finish(self, progress) -> None:
        """The run's end: why it ends here if early, summary.json and run.json, the original script's summary."""
        if progress.stopped_early:
            log(f"Target accuracy reached. Early stopping after epoch {progress.epoch}.")
        elif progress.epoch == self.cfg.stop_after_epoch and progress.epoch < self.cfg.epochs:
            log(f"Stopping after epoch {progress.epoch} as asked (--stop-after-epoch); run again to resume.")
        env, history, total_s = self.env, progress.history, progress.total_time_s
        n_train, n_test = self.n_train, self.n_test
        summary = {
            "data": self.config["data"], "total_time_s": total_s, "world_size": env.world_size,
            "nodes": self.config["nodes"],
            "images_per_s": progress.total_images / total_s if total_s else 0.0,
            "processes_per_node": env.local_world_size, "device": env.device.type,
            # named as the log's lines name them: GPUs on CUDA, CPU processes on a CPU
            **({"gpus_per_node": env.local_world_size} if env.cuda else
               {"gpus_per_node": 0, "cpu_processes_per_node": env.local_world_size}),
            "hosts": sorted({r["host"] for r in self.ranks}), "epochs_completed": progress.epoch,
            "finished": progress.stopped_early or progress.epoch >= self.cfg.epochs,
            "stopped_early": progress.stopped_early,
            "best_val_acc": max((m["val_acc"] for m in history), default=0.0),
            "final_val_acc": history[-1]["val_acc"] if history else 0.0, "n_train": n_train, "n_test": n_test,
            # the test accuracy after the last epoch, as papers report it (without --val-size: final_val_acc, same set)
            "final_test_acc": history[-1].get("test_acc", history[-1]["val_acc"]) if history else 0.0,
            "config": self.config,
        }
        # the first epoch at --target-accuracy, and the training seconds (and with evaluation) it took to get there
        reached = next((m for m in history if m["val_acc"] >= self.cfg.target_accuracy), None)
        summary.update(target_accuracy=self.cfg.target_accuracy, target_epoch=reached and reached["epoch"],
                       target_train_time_s=reached and reached.get("train_time_s"),
                       target_run_time_s=reached and reached.get("run_time_s"))
        if history and "test_acc" in history[0]:
            best = max(history, key=lambda m: m["val_acc"])  # the first of equals, as best.pt
            summary.update(best_val_epoch=best["epoch"], test_acc_at_best_val=best["test_acc"])

        def write_end():
            write_json(os.path.join(self.cfg.out_dir, "summary.json"), summary)
            write_json(os.path.join(self.cfg.out_dir, "run.json"), {**self.record, "end_time": now_iso()})
            if self.tensorboard:
                self.tensorboard.close()
        self._write(write_end, "the run's summary (summary.json, run.json)")
        log("\nTraining Summary:")
        log(f"Total training time: {total_s:.3f} seconds")
        log(f"Throughput: {summary['images_per_s']:.3f} images/second")
        unit = "GPUs" if env.cuda else "CPU processes"  # as the start lines say
        log(f"Number of nodes: {summary['nodes']}")
        log(f"Number of {unit} per node: {env.local_world_size}")
        log(f"Total {unit} used: {env.world_size}")
        log("Training completed successfully." if summary["finished"] else
            f"Training paused after epoch {progress.epoch} of {self.cfg.epochs}; run again to resume.")
        if history:  # what the run got, and where it is
            best = max(history, key=lambda m: m["val_acc"])
            log(f"Result: final validation accuracy {history[-1]['val_acc']:.4f} (epoch "
                f"{history[-1]['epoch']}), best {best['val_acc']:.4f} (epoch {best['epoch']}); checkpoint "
                f"{os.path.join(self.cfg.out_dir, 'checkpoint.pt')}")
            if "test_acc" in history[-1]:
                log(f"Test accuracy: final {history[-1]['test_acc']:.4f}, at the best validation epoch "
                    f"{best['test_acc']:.4f} ({os.path.join(self.cfg.out_dir, 'best.pt')})")

    @staticmethod
    def write_evaluation(metrics: dict, *, cfg, env: DistEnv, epoch: int, path: str,
                         top5: bool = True) -> None:
        """--evaluate's two lines (top-5 only with more than 5 classes: `top5`), and eval.json."""
        out_dir = cfg.out_dir
        log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
        log(f"Validation Top-5 Accuracy: {metrics['val_top5']:.4f} on {metrics['val_count']} images"
            if top5 else f"Scored on {metrics['val_count']} images")
        record = {**metrics, "epoch": epoch, "world_size": env.world_size, "checkpoint": path}
        write_on_main(env, lambda: write_json(os.path.join(out_dir, "eval.json"), record), what="eval.json",
                      out_dir=out_dir, then="evaluate again")


def log_epoch(metrics: dict, epochs: int, *, top5: bool = True) -> None:
    """The original script's four lines per epoch (top-5 left out where `top5` is false: 5 classes or fewer,
    where it is always 1); then, where they apply, the peak GPU memory, the rank that held the others back,
    a loader that does not keep up, and fp16's skipped steps."""
    log(f"Epoch {metrics['epoch']}/{epochs} completed in {metrics['epoch_time_s']:.3f} seconds")
    log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
    log(f"Epoch Throughput: {metrics['images_per_s']:.3f} images/second")
    log(f"Train Loss: {metrics['train_loss']:.4f}" +
        (f", Validation Top-5 Accuracy: {metrics['val_top5']:.4f}" if top5 else ""))
    if "test_acc" in metrics:  # --val-size: the lines above score the validation split, this one the test set
        log(f"Test Loss: {metrics['test_loss']:.4f}, Test Accuracy: {metrics['test_acc']:.4f}" +
            (f", Test Top-5 Accuracy: {metrics['test_top5']:.4f}" if top5 else ""))
    if metrics.get("scored") == "model_ema":
        log("(scores of the weight EMA, --model-ema)")
    if "grad_norm" in metrics:
        skipped = metrics["nonfinite_grad_steps"]
        log(f"Gradient norm before clipping: {metrics['grad_norm']:.3f} (mean over the epoch's finite norms"
            f"{f'; {skipped} steps had a non-finite norm (fp16: the scaler skipped them)' if skipped else ''}"
            ")")
    if "peak_memory_gib" in metrics:  # CUDA
        ranks = metrics["rank_times"]
        top = max(ranks, key=lambda r: r["peak_memory_gib"])
        log(f"Peak GPU memory: {top['peak_memory_gib']:.2f} GiB (rank {top['rank']} on {top['host']}; "
            f"the least {min(r['peak_memory_gib'] for r in ranks):.2f} GiB)")
    if metrics.get("slow_rank"):
        log(f"warning: one rank held the others back: {metrics['slow_rank']} (each rank's split: "
            f"rank_times in metrics.jsonl)")
    if metrics.get("input_bound"):
        log(f"warning: the loader does not keep up: {metrics['input_bound']}: bench.py --loader-check with this "
            f"run's flags measures it and names the fixes that fit (more --workers, the data on each node's local "
            f"disk with STAGE_DATA, the other --loader)")
    if metrics.get("nonfinite_samples"):
        log(f"warning: {metrics['nonfinite_samples']} samples had a non-finite fp16 loss; the scaler skipped "
            f"their steps")


def provenance(config: dict, ranks: list) -> dict:
    """What a run ran on, for run.json: code version, library versions, devices, hosts, Slurm."""
    import subprocess
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = (bool(subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                     capture_output=True, text=True, timeout=10).stdout.strip())
                 if commit else None)
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    cuda = torch.cuda.is_available()
    return {
        "config": config, "git_commit": commit, "git_dirty": dirty,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                     "cudnn": torch.backends.cudnn.version() if cuda else None},
        # the kernels' settings (train_ddp.choose_kernels; --deterministic), as this run applied them
        "kernels": {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                    "cudnn_deterministic": torch.backends.cudnn.deterministic,
                    "cudnn_benchmark": torch.backends.cudnn.benchmark,
                    "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")},
        "world_size": len(ranks), "ranks": ranks,
        "slurm": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_") and "TOKEN" not in k},
        "start_time": now_iso(), "end_time": None,
    }
