"""Plots from run directories and benchmark results, as PNG files (needs matplotlib: pip install -e '.[plot]').

    python plot.py runs/wrn            # runs/wrn/curves.png: loss, accuracy, throughput, LR, each rank's time
    python plot.py runs/wrn runs/other # runs/plots/wrn+other.png: the runs side by side
    python plot.py runs/sweep/*-seed*  # NAME-seedN: each configuration's mean, with a band
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


def describe_runs(run_dirs: list) -> str:
    """The title: each distinct model, global batch and peak LR of the runs (from their config.json)."""
    seen = []
    for d in run_dirs:
        try:
            with open(os.path.join(d, "config.json")) as f:
                c = json.load(f)
        except (OSError, ValueError):
            continue
        text = f"WRN-{c['depth']}-{c['widen_factor']}, global batch {c['batch_size']}, peak LR {c['lr']:.3g}"
        text += f" ({c['data']})" if c.get("data") else ""
        if text not in seen:
            seen.append(text)
    return "\n".join(seen)


def default_path(run_dirs: list) -> str:
    """Where a call's figure goes: beside a single run (RUN/curves.png), or for several runs under
    runs/plots/, named after them, so that another call on other runs never overwrites it."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(names) == 1:
        return os.path.join(run_dirs[0], "curves.png")
    return os.path.join("runs", "plots", "+".join(dict.fromkeys(names))[:150] + ".png")


PHASE_COLOURS = {"data": "tab:orange", "compute": "tab:blue", "sync": "tab:red", "optimizer": "tab:green",
                 "other": "tab:gray"}


def holds_start_up(row: dict) -> bool:
    """Whether an epoch's time holds a start-up: the first epoch a process trained (a new run's epoch 1, or a
    resumed run's first epoch), as train_ddp.py marks it; epoch 1 in records written before the mark."""
    return row.get("includes_start_up", row["epoch"] == 1)


def plot_runs(run_dirs: list, path: str) -> dict:
    """One figure, `path`: loss, top-1 accuracy (training, and the test set, or with --val-size the validation
    split and the test set), training throughput (the epochs that hold a start-up, epoch 1 and a resumed run's
    first, marked apart), the LR, and each rank's split of its step time in the last epoch (rank_times). One
    colour per configuration, one line style per quantity; several seeds of one configuration (NAME-seed0,
    NAME-seed1, ...) are drawn as their mean with a band from their minimum to their maximum. The LR and the
    time split are each configuration's first run's, labelled with its name. Returns {path: figure}."""
    plt = _pyplot()
    groups = group_runs(run_dirs)
    held_out = any("test_acc" in m[0] for runs in groups.values() for _, m in runs)
    scored = "validation" if held_out else "test"  # without --val-size the log's "Validation" is the test set
    curves = {"loss": [("train_loss", "train", "-"), ("val_loss", scored, "--")]
              + ([("test_loss", "test", "-.")] if held_out else []),
              "top-1 accuracy": [("train_acc", "train", "-"), ("val_acc", scored, "--")]
              + ([("test_acc", "test", "-.")] if held_out else []),
              "training images/s": [("images_per_s", "", "-")]}
    # each configuration's first run's ranks in its last epoch, labelled by configuration
    bars = [(config, rank) for config, runs in groups.items() for rank in runs[0][1][-1].get("rank_times", [])]
    heights = [3, 3, 2, 1.5] + ([max(2, 0.3 * len(bars))] if bars else [])
    fig, axes = plt.subplots(len(heights), 1, figsize=(10, 3 * len(heights)),
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (config, runs) in enumerate(groups.items()):
        colour = colours[i % len(colours)]
        n = min(len(metrics) for _, metrics in runs)  # the epochs every seed has
        epochs = [m["epoch"] for m in runs[0][1]][:n]
        seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
        for ax, (ylabel, keys) in zip(axes, curves.items()):
            for key, label, style in keys:
                if key not in runs[0][1][0]:
                    continue
                values = [[metrics[e][key] for _, metrics in runs] for e in range(n)]
                mean = [sum(v) / len(v) for v in values]
                # throughput: an epoch that holds a start-up (any seed's) is slower: marked apart, not joined
                apart = ([e for e in range(n) if any(holds_start_up(metrics[e]) for _, metrics in runs)]
                         if key == "images_per_s" and n > 1 else [])
                kept = [e for e in range(n) if e not in apart]
                ax.plot([epochs[e] for e in kept], [mean[e] for e in kept], linestyle=style, color=colour,
                        marker="o" if n < 30 else None,
                        markersize=3, label=" ".join(filter(None, (config, label))) + seeds)
                if apart:
                    which = ("epoch 1" if [epochs[e] for e in apart] == [1] else
                             "epochs " + ", ".join(str(epochs[e]) for e in apart))
                    ax.plot([epochs[e] for e in apart], [mean[e] for e in apart], linestyle="none", marker="o",
                            markerfacecolor="none", color=colour,
                            label=f"{config}: {which}, with the start-up (a new run's or a resume's)")
                if len(runs) > 1:
                    ax.fill_between(epochs, [min(v) for v in values], [max(v) for v in values], color=colour,
                                    alpha=0.15, linewidth=0)
            ax.set_ylabel(ylabel)
    for i, (config, runs) in enumerate(groups.items()):  # each configuration's schedule, in its colour
        rows = runs[0][1]
        axes[3].plot([m["epoch"] for m in rows], [m["lr"] for m in rows], color=colours[i % len(colours)],
                     label=config if len(groups) > 1 else None)
    axes[3].set_ylabel("LR (epoch's end)")
    for ax in axes[:4]:
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            # outside: the curves show
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    if bars:  # where each rank's step time went, in each configuration's last epoch
        ax = axes[4]
        left = [0.0] * len(bars)
        names = [f"{config + ': ' if len(groups) > 1 else ''}rank {r['rank']} ({r['host']})" for config, r in bars]
        for phase, colour in PHASE_COLOURS.items():
            widths = [r[f"{phase}_s"] for _, r in bars]
            ax.barh(range(len(bars)), widths, left=left, color=colour, label=phase)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_yticks(range(len(bars)), names)
        ax.invert_yaxis()  # the first run's ranks on top
        last = {config: runs[0][1][-1]["epoch"] for config, runs in groups.items()}
        ax.set_xlabel("seconds per step, in the last epoch: " + ", ".join(f"{c} {e}" for c, e in last.items()))
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(describe_runs(run_dirs) or "")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    return {path: fig}


def plot_scaling(bench_files: list, out_dir: str) -> dict:
    """scaling.png: global img/s against the number of GPUs, a curve per --comm-hook (jobs/scaling.sh's
    COMM_HOOKS), with the ideal line from none's smallest run, and each curve's scaling efficiency (per-GPU img/s
    relative to its smallest run) on a second axis."""
    plt = _pyplot()
    curves = {}  # comm hook -> [(GPUs, img/s)]
    for path in bench_files:
        with open(path) as f:
            r = json.load(f)
        hook = r["config"].get("comm_hook", "none")  # older results: DDP's own all-reduce
        curves.setdefault(hook, []).append((r["world_size"], r["ours"]["images_per_s"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax2 = ax.twinx()
    gpus = sorted({n for points in curves.values() for n, _ in points})
    first = min(curves.get("none") or next(iter(curves.values())))  # the ideal's base: none's smallest run
    for hook, points in sorted(curves.items(), key=lambda kv: kv[0] != "none"):
        points.sort()
        n0, ips0 = points[0]
        label = "measured" if len(curves) == 1 else f"--comm-hook {hook}"
        line, = ax.plot([n for n, _ in points], [v for _, v in points], marker="o", label=label)
        ax2.plot([n for n, _ in points], [100 * (v / n) / (ips0 / n0) for n, v in points], marker="s",
                 linestyle=":", color=line.get_color(), label=f"efficiency % ({hook})" if len(curves) > 1
                 else "efficiency %")
    ax.plot(gpus, [first[1] / first[0] * n for n in gpus], linestyle="--", color="gray", label="ideal (linear)")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("images/s")
    ax.set_xticks(gpus)
    ax.grid(alpha=0.3)
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
    p.add_argument("--out", default=None, help="the PNG file (default: RUN/curves.png for one run, else "
                   "runs/plots/<the runs' names>.png; with --scaling, a folder: runs/plots)")
    args = p.parse_args(argv)
    if args.scaling:
        os.makedirs(args.out or "runs/plots", exist_ok=True)
        figures = {os.path.join(args.out or "runs/plots", name): fig
                   for name, fig in plot_scaling(args.paths, args.out or "runs/plots").items()}
    else:
        figures = plot_runs(args.paths, args.out or default_path(args.paths))
    for path in figures:
        print(path)


if __name__ == "__main__":
    from tools.tool_exit import catch_stop_signals
    catch_stop_signals()  # SIGTERM and Ctrl-C: out at once, in one line
    main()
