"""Plots from run directories and benchmark results, as PNG files (needs matplotlib: pip install -e '.[plot]').

    python plot.py runs/wrn runs/other --out runs/plots  # loss, accuracy and throughput per epoch
    python plot.py --scaling bench-results/*.json --out runs/plots  # img/s and efficiency against GPUs

SIGTERM and Ctrl-C stop it at once: one line on stderr, exit status 128 + the signal's number (143, 130).
"""
import argparse
import json
import os
import sys


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: plotting needs matplotlib: pip install -e '.[plot]'")
    matplotlib.use("Agg")  # files only, no display needed on a login node
    import matplotlib.pyplot as plt
    return plt


def read_metrics(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        sys.exit(f"error: {path} does not exist: pass directories that train_ddp.py wrote (--out-dir)")
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    if not rows:
        sys.exit(f"error: {run_dir} has no finished epoch yet (metrics.jsonl gets a row at the end of each "
                 f"epoch): plot it again after the first")
    return rows


def plot_runs(run_dirs: list, out_dir: str) -> dict:
    """loss.png (train and validation loss), accuracy.png (top-1 and top-5), throughput.png:
    one curve per run and quantity, against the epoch. Returns {file name: figure}."""
    plt = _pyplot()
    runs = {os.path.basename(os.path.normpath(d)) or d: read_metrics(d) for d in run_dirs}
    panels = {"loss.png": ("loss", [("train_loss", "train"), ("val_loss", "validation")]),
              "accuracy.png": ("validation accuracy", [("val_acc", "top-1"), ("val_top5", "top-5")]),
              "throughput.png": ("training images/s", [("images_per_s", "")])}
    figures = {}
    for name, (ylabel, keys) in panels.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run, metrics in runs.items():
            epochs = [m["epoch"] for m in metrics]
            for key, label in keys:
                ax.plot(epochs, [m[key] for m in metrics], marker="o", label=f"{run} {label}".strip())
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=120)
        figures[name] = fig
    return figures


def plot_scaling(bench_files: list, out_dir: str) -> dict:
    """scaling.png: global img/s against the number of GPUs, with the ideal line, and the scaling
    efficiency (per-GPU img/s relative to the smallest run) on a second axis."""
    plt = _pyplot()
    points = []
    for path in bench_files:
        with open(path) as f:
            r = json.load(f)
        points.append((r["world_size"], r["ours"]["images_per_s"]))
    points.sort()
    n0, ips0 = points[0]
    gpus, ips = [p[0] for p in points], [p[1] for p in points]
    efficiency = [100 * (v / n) / (ips0 / n0) for n, v in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(gpus, ips, marker="o", label="measured")
    ax.plot(gpus, [ips0 / n0 * n for n in gpus], linestyle="--", label="ideal (linear)")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("images/s")
    ax.set_xticks(gpus)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(gpus, efficiency, marker="s", color="tab:green", label="efficiency %")
    ax2.set_ylabel("scaling efficiency (%)")
    ax2.set_ylim(0, 110)
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "scaling.png"), dpi=120)
    return {"scaling.png": fig}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", help="run directories, or with --scaling benchmark JSON files")
    p.add_argument("--scaling", action="store_true", help="the paths are bench.py JSON results")
    p.add_argument("--out", default="runs/plots", help="directory for the PNG files")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    figures = (plot_scaling if args.scaling else plot_runs)(args.paths, args.out)
    for name in figures:
        print(os.path.join(args.out, name))


if __name__ == "__main__":
    from machinery.signals import catch_stop_signals
    catch_stop_signals()  # SIGTERM and Ctrl-C: out at once, in one line
    main()
