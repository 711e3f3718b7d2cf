"""Plots from run directories and benchmark results, as PNG files (needs matplotlib: pip install -e '.[plot]').

    python plot.py runs/wrn runs/other --out runs/plots  # loss, accuracy and throughput per epoch, and the LR
    python plot.py runs/sweep/*-seed* --out runs/plots   # NAME-seedN: each configuration's mean, with a band
    python plot.py --scaling bench-results/*.json --out runs/plots  # img/s and efficiency against GPUs

SIGTERM and Ctrl-C stop it at once: one line on stderr, exit status 128 + the signal's number (143, 130).
"""
import argparse
import json
import os
import re
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


SEED_SUFFIX = re.compile(r"[-_]seed\d+$")  # runs named NAME-seed0, NAME-seed1, ... are one configuration


def group_runs(run_dirs: list) -> dict:
    """{configuration: [(run name, metrics)]}: runs whose names differ only in a -seedN suffix form one."""
    groups = {}
    for d in run_dirs:
        name = os.path.basename(os.path.normpath(d)) or d
        groups.setdefault(SEED_SUFFIX.sub("", name), []).append((name, read_metrics(d)))
    return groups


def plot_runs(run_dirs: list, out_dir: str) -> dict:
    """loss.png (train and validation loss), accuracy.png (top-1 and top-5; with --val-size, the test set's
    top-1 too), throughput.png: one colour per configuration, one line style per quantity, against the epoch,
    and the LR in a panel below. Several seeds of one configuration (NAME-seed0, NAME-seed1, ...) are drawn as
    their mean with a band from their minimum to their maximum. Returns {file name: figure}."""
    plt = _pyplot()
    groups = group_runs(run_dirs)
    test_too = any("test_acc" in m[0] for runs in groups.values() for _, m in runs)
    panels = {"loss.png": ("loss", [("train_loss", "train", "-"), ("val_loss", "validation", "--")]),
              "accuracy.png": ("accuracy", [("val_acc", "top-1", "-"), ("val_top5", "top-5", ":")]
                               + ([("test_acc", "test top-1", "-.")] if test_too else [])),
              "throughput.png": ("training images/s", [("images_per_s", "", "-")])}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figures = {}
    for name, (ylabel, keys) in panels.items():
        fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
        for i, (config, runs) in enumerate(groups.items()):
            colour = colours[i % len(colours)]
            epochs = [m["epoch"] for m in runs[0][1]]
            n = min(len(metrics) for _, metrics in runs)  # the epochs every seed has
            seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
            for key, label, style in keys:
                if key not in runs[0][1][0]:
                    continue
                values = [[metrics[e][key] for _, metrics in runs] for e in range(n)]
                mean = [sum(v) / len(v) for v in values]
                ax.plot(epochs[:n], mean, linestyle=style, color=colour, marker="o" if n < 30 else None,
                        markersize=3, label=f"{config} {label}{seeds}".strip())
                if len(runs) > 1:
                    ax.fill_between(epochs[:n], [min(v) for v in values], [max(v) for v in values], color=colour,
                                    alpha=0.15, linewidth=0)
            ax_lr.plot(epochs[:n], [runs[0][1][e]["lr"] for e in range(n)], color=colour)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        ax_lr.set_ylabel("LR (epoch's end)")
        ax_lr.set_xlabel("epoch")
        ax_lr.xaxis.get_major_locator().set_params(integer=True)
        ax_lr.grid(alpha=0.3)
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
