"""The run's files (config.json, metrics.jsonl, run.json, summary.json, eval.json, TensorBoard) and lines."""
import functools
import json
import os
import sys
import time
from dataclasses import asdict

import torch

from machinery.data_names import records_name
from machinery.files import now_iso, write_json, write_on_main, write_text
from machinery.launch import DistEnv, gather_ranks
from machinery.output import describe_span, log


def describe_run_eta(done: int, epochs: int, seconds_per_epoch: float) -> str:
    left_s = (epochs - done) * seconds_per_epoch
    when = time.strftime("%H:%M" if left_s < 20 * 3600 else "%a %H:%M", time.localtime(time.time() + left_s))
    return (f"Run: {done} of {epochs} epochs done; about {describe_span(left_s)} left (ends about {when}) "
            f"at this session's pace")


class RunFiles:
    """Rank 0 writes, all agree; metrics.jsonl is rewritten whole: no partial line, no epoch twice."""

    def __init__(self, cfg, env: DistEnv, data, *, history: list, lock):
        config = {**cfg.to_dict(), "dataset": records_name(cfg.dataset, cfg.data_dir, data.source),
                  "data": data.source, "data_spec": asdict(data.spec)}
        self.cfg, self.env, self.config, self.data, self.ranks = cfg, env, config, data, gather_ranks(env)
        self.write = functools.partial(write_on_main, env, out_dir=cfg.out_dir, lock=lock)
        self.rows = [json.dumps(m) + "\n" for m in history]
        self.record, self.tensorboard = provenance(config, self.ranks) if env.is_main else None, None
        self.started, self.epochs_here = time.perf_counter(), 0  # the run ETA's pace

        def write_start():
            write_json(os.path.join(cfg.out_dir, "config.json"), config)
            write_text(os.path.join(cfg.out_dir, "metrics.jsonl"), "".join(self.rows))
            write_json(os.path.join(cfg.out_dir, "run.json"), self.record)
            if cfg.tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # check_args made sure it imports
                self.tensorboard = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))
        self.write(write_start, what="the run's records (config.json, metrics.jsonl, run.json)")

    def add_epoch(self, metrics: dict) -> None:
        """The original script's four lines, then those that apply; metrics.jsonl, TensorBoard; the run's ETA."""
        top5 = self.data.spec.num_classes > 5  # always 1 with 5 classes or fewer
        log(f"Epoch {metrics['epoch']}/{self.cfg.epochs} completed in {metrics['epoch_time_s']:.3f} seconds")
        log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
        log(f"Epoch Throughput: {metrics['images_per_s']:.3f} images/second")
        log(f"Train Loss: {metrics['train_loss']:.4f}" +
            (f", Validation Top-5 Accuracy: {metrics['val_top5']:.4f}" if top5 else ""))
        if "test_acc" in metrics:  # --val-size: the lines above score the validation split
            log(f"Test Loss: {metrics['test_loss']:.4f}, Test Accuracy: {metrics['test_acc']:.4f}" +
                (f", Test Top-5 Accuracy: {metrics['test_top5']:.4f}" if top5 else ""))
        if metrics.get("scored") == "model_ema":
            log("(scores of the weight EMA, --model-ema)")
        if "grad_norm" in metrics:
            log(f"Gradient norm before clipping: {metrics['grad_norm']:.3f} (mean of the epoch's finite norms; "
                f"{metrics['nonfinite_grad_steps']} steps skipped for a non-finite norm)")
        if "peak_memory_gib" in metrics:  # CUDA
            top = max(metrics["rank_times"], key=lambda r: r["peak_memory_gib"])
            log(f"Peak GPU memory: {top['peak_memory_gib']:.2f} GiB (rank {top['rank']} on {top['host']})")
        if metrics.get("slow_rank"):
            log(f"warning: one rank held the others back: {metrics['slow_rank']} (each rank's split: rank_times)")
        if metrics.get("input_bound"):
            log(f"warning: the loader does not keep up: {metrics['input_bound']}: bench.py --loader-check with this "
                f"run's flags names the fixes (more --workers, STAGE_DATA to local disks, the other --loader)")
        if metrics.get("nonfinite_samples"):
            log(f"warning: {metrics['nonfinite_samples']} samples had a non-finite fp16 loss; their steps skipped")
        self.rows.append(json.dumps(metrics) + "\n")

        def write_epoch():
            write_text(os.path.join(self.cfg.out_dir, "metrics.jsonl"), "".join(self.rows))
            if self.tensorboard:
                for key in (k for k, v in metrics.items() if type(v) in (int, float)):  # numbers, not marks (bools)
                    self.tensorboard.add_scalar(key, metrics[key], metrics["epoch"])
                self.tensorboard.flush()  # a preempted run keeps its curves too
        self.write(write_epoch, what=f"epoch {metrics['epoch']}'s metrics")
        self.epochs_here += 1
        if metrics["epoch"] < self.cfg.epochs:
            log(describe_run_eta(metrics["epoch"], self.cfg.epochs,
                                 (time.perf_counter() - self.started) / self.epochs_here))

    def finish(self, progress) -> None:
        """The run's end: why, if early; summary.json, run.json; the original script's summary."""
        cfg, env, history, total_s = self.cfg, self.env, progress.history, progress.total_time_s
        if progress.stopped_early:
            log(f"Target accuracy reached. Early stopping after epoch {progress.epoch}.")
        elif progress.epoch == cfg.stop_after_epoch and progress.epoch < cfg.epochs:
            log(f"Stopping after epoch {progress.epoch} as asked (--stop-after-epoch); run again to resume.")
        last = history[-1] if history else {"val_acc": 0.0}
        best = max(history, key=lambda m: m["val_acc"], default=last)  # the first of equals, as best.pt
        reached = next((m for m in history if m["val_acc"] >= cfg.target_accuracy), {})
        summary = {
            "data": self.config["data"], "total_time_s": total_s, "world_size": env.world_size,
            "nodes": self.config["nodes"], "images_per_s": progress.total_images / total_s if total_s else 0.0,
            "processes_per_node": env.local_world_size, "device": env.device.type,
            "gpus_per_node": env.local_world_size if env.cuda else 0,  # named as the log's lines name them
            **({} if env.cuda else {"cpu_processes_per_node": env.local_world_size}),
            "hosts": sorted({r["host"] for r in self.ranks}), "epochs_completed": progress.epoch,
            "finished": progress.stopped_early or progress.epoch >= cfg.epochs,
            "stopped_early": progress.stopped_early, "best_val_acc": best["val_acc"],
            "final_val_acc": last["val_acc"], "n_train": len(self.data.train), "n_test": len(self.data.test),
            # the last epoch's, as papers report it (no --val-size: the validation set's)
            "final_test_acc": last.get("test_acc", last["val_acc"]), "config": self.config,
            "target_accuracy": cfg.target_accuracy, "target_epoch": reached.get("epoch"),
            "target_train_time_s": reached.get("train_time_s"), "target_run_time_s": reached.get("run_time_s"),
        }
        if "test_acc" in best:  # --val-size
            summary.update(best_val_epoch=best["epoch"], test_acc_at_best_val=best["test_acc"])

        def write_end():
            write_json(os.path.join(cfg.out_dir, "summary.json"), summary)
            write_json(os.path.join(cfg.out_dir, "run.json"), {**self.record, "end_time": now_iso()})
            if self.tensorboard:
                self.tensorboard.close()
        self.write(write_end, what="the run's summary (summary.json, run.json)")
        log("\nTraining Summary:")
        log(f"Total training time: {total_s:.3f} seconds")
        log(f"Throughput: {summary['images_per_s']:.3f} images/second")
        log(f"Number of nodes: {summary['nodes']}")
        unit = "GPUs" if env.cuda else "CPU processes"  # as the start lines say
        log(f"Number of {unit} per node: {env.local_world_size}")
        log(f"Total {unit} used: {env.world_size}")
        log("Training completed successfully." if summary["finished"] else
            f"Training paused after epoch {progress.epoch} of {cfg.epochs}; run again to resume.")
        if history:  # what the run got, and where it is
            log(f"Result: final validation accuracy {last['val_acc']:.4f} (epoch {last['epoch']}), best "
                f"{best['val_acc']:.4f} (epoch {best['epoch']}); checkpoint "
                f"{os.path.join(cfg.out_dir, 'checkpoint.pt')}")
            if "test_acc" in last:
                log(f"Test accuracy: final {last['test_acc']:.4f}, at the best validation epoch "
                    f"{best['test_acc']:.4f} ({os.path.join(cfg.out_dir, 'best.pt')})")

    @staticmethod
    def write_evaluation(metrics: dict, *, cfg, env: DistEnv, epoch: int, path: str,
                         top5: bool = True) -> None:
        """--evaluate's two lines (top-5 only with more than 5 classes: `top5`), and eval.json."""
        log(f"Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_acc']:.4f}")
        log(f"Validation Top-5 Accuracy: {metrics['val_top5']:.4f} on {metrics['val_count']} images"
            if top5 else f"Scored on {metrics['val_count']} images")
        record = {**metrics, "epoch": epoch, "world_size": env.world_size, "checkpoint": path}
        write_on_main(env, lambda: write_json(os.path.join(cfg.out_dir, "eval.json"), record), what="eval.json",
                      out_dir=cfg.out_dir, then="evaluate again")


def provenance(config: dict, ranks: list) -> dict:
    """What a run ran on, for run.json: code version, library versions, devices, hosts, Slurm."""
    import subprocess
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project

    def git(*args):
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD") or None
        dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    cuda = torch.cuda.is_available()
    return {
        "config": config, "git_commit": commit, "git_dirty": dirty, "start_time": now_iso(), "end_time": None,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                     "cudnn": torch.backends.cudnn.version() if cuda else None},
        "kernels": {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),  # as this run set them
                    "cudnn_deterministic": torch.backends.cudnn.deterministic,
                    "cudnn_benchmark": torch.backends.cudnn.benchmark,
                    "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")},
        "world_size": len(ranks), "ranks": ranks,
        "slurm": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_") and "TOKEN" not in k},
    }
