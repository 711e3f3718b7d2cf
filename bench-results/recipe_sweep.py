"""The modern recipe's options measured on real data: Fashion-MNIST (Debian's dataset-fashion-mnist), each
configuration over several seeds, one process at a time, final-epoch test accuracy and time.

    .venv/bin/python bench-results/recipe_sweep.py --out runs/sweep --json bench-results/fashion-recipe.json

It copies train_ddp.py with load_data replaced by the README's Fashion-MNIST block (as the tests do), runs
every (configuration, seed) that has no summary.json yet under --out (so a stopped sweep resumes), scores each
run's final weights on the whole test set (10,000 images: `--evaluate --test-size 0`), and prints the table
bench-results/README.md holds: per configuration that final-epoch test accuracy's mean, sample standard
deviation and range over the seeds, and the mean training time. plot.py draws the runs' curves (the epochs are
scored on the regime's --test-size share, to keep the runs short).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FASHION = "/usr/share/datasets/fashion-mnist"


COMMON = ["--depth", "10", "--widen-factor", "2", "--batch-size", "64", "--base-lr", "0.1",
          "--reference-batch-size", "128", "--log-every", "0", "--target-accuracy", "1.0"]
REGIMES = {
    "few": COMMON + ["--train-size", "250", "--test-size", "500", "--epochs", "120"],
    "long": COMMON + ["--train-size", "500", "--test-size", "1000", "--epochs", "60"],
    "short": COMMON + ["--train-size", "1000", "--test-size", "2000", "--epochs", "24"],
    "more": COMMON + ["--train-size", "5000", "--test-size", "2000", "--epochs", "10"],
}

CONFIGS = {
    "baseline": [],
    "model-ema": ["--model-ema", "--model-ema-decay", "0.92"],  # per step 0.92^(64/128) = 0.959: ~25 steps
    "clip-grad-norm": ["--clip-grad-norm", "1"],
    "random-erase": ["--random-erase", "0.5"],
    "ta_wide": ["--auto-augment", "ta_wide"],
    "mixup": ["--mixup-alpha", "0.2"],
    "cutmix": ["--cutmix-alpha", "1.0"],
    "norm-weight-decay-0": ["--norm-weight-decay", "0"],
    # --recipe modern's options until 2026-11-25, when the rule of bench-results/README.md dropped mixup
    "modern": ["--mixup-alpha", "0.2", "--tta"],
}

# Configurations that train nothing: another configuration's final weights scored again with other evaluation
# flags.
DERIVED = {
    "tta": ("baseline", ["--tta"]),  # the mirror alone: the baseline's weights scored with it
    "modern-no-tta": ("modern", ["--no-tta"]),  # mixup alone: the preset's weights scored without the mirror
}


def readme_load_data() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    after = text.split("<!-- worked example: the tests replace load_data with exactly this block -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def write_script(folder: str) -> str:
    """train_ddp.py with load_data replaced by the README's Fashion-MNIST block, in `folder`."""
    src = open(os.path.join(ROOT, "train_ddp.py")).read()
    start = src.index("\ndef load_data(") + 1
    end = re.compile(r"^\S", re.M).search(src, src.index("\n", start) + 1).start()
    src = src[:start] + readme_load_data().strip("\n") + "\n\n\n" + src[end:]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "train_fashion.py")
    with open(path, "w") as f:
        f.write(src)
    return path


def score_whole_test_set(script: str, out: str, env: dict, eval_flags: tuple = ()) -> float:
    """The final weights in `out` scored on all the test images (with `eval_flags`, else as the run
    evaluated), once: cached in out."""
    path = os.path.join(out, "whole-test" + "".join(eval_flags).replace("--", "-") + ".json")
    if not os.path.exists(path):
        subprocess.run([sys.executable, script, "--evaluate", "--test-size", "0", "--loader", "gpu",
                        *eval_flags, "--data-dir", FASHION, "--out-dir", out], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        os.replace(os.path.join(out, "eval.json"), path)
    with open(path) as f:
        result = json.load(f)
    assert result["val_count"] == 10000, path
    return result["val_acc"]


def summarise(accs: list) -> str:
    sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
    return f"{statistics.mean(accs):.2f} ± {sd:.2f} ({min(accs):.2f}-{max(accs):.2f})"


def compare(accs: list, base: list | None) -> str:
    """The difference of the means, its standard error (Welch's, from both spreads) and their ratio, Welch's
    t."""
    if not base or accs is base or len(accs) < 2 or len(base) < 2:
        return ""
    diff = statistics.mean(accs) - statistics.mean(base)
    se = (statistics.variance(accs) / len(accs) + statistics.variance(base) / len(base)) ** 0.5
    return f"{diff:+.2f} ± {se:.2f} (t = {diff / se:.1f})"


# against the baseline, the paper's recipe (bench-results/README.md)
CANDIDATES = ("modern", "modern-no-tta", "tta")
LABELS = {"baseline": "paper's recipe", "modern": "mixup + mirror (old preset)",
          "modern-no-tta": "mixup alone",
          "tta": "mirror alone"}
REGIME_TEXT = {"few": "250 images, 120 epochs", "long": "500 images, 60 epochs",
               "short": "1,000 images, 24 epochs", "more": "5,000 images, 10 epochs"}


def read_runs(paths: list, rename: dict) -> tuple:
    """Every run of the JSON files, configurations renamed (`rename`: old -> new); a (configuration, seed) met
    again must have the same accuracy (a rerun of the same training), else it is reported. Returns (rows by
    (configuration, seed), the mismatches)."""
    rows, mismatches = {}, []
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["runs"]:
                key = (rename.get(r["config"], r["config"]), r["seed"])
                if key in rows and rows[key]["final_test_acc"] != r["final_test_acc"]:
                    mismatches.append((key, rows[key]["final_test_acc"], r["final_test_acc"], path))
                rows.setdefault(key, {**r, "config": key[0], "from": os.path.basename(path)})
    return rows, mismatches


def welch(accs: list, base: list) -> tuple:
    diff = statistics.mean(accs) - statistics.mean(base)
    se = (statistics.variance(accs) / len(accs) + statistics.variance(base) / len(base)) ** 0.5
    return diff, se, diff / se


def report(regimes: dict, rename: dict, figure: str | None, merged_dir: str | None) -> int:
    """The tables per regime, the decision rule of bench-results/README.md applied to each candidate, and the
    figure of the final accuracy of each configuration, per regime, every seed shown."""
    results = {}
    for regime, paths in regimes.items():
        rows, mismatches = read_runs(paths, rename)
        for key, a, b, path in mismatches:
            print(f"MISMATCH {regime} {key}: {a} then {b} in {path}")
        accs = {}
        for (config, seed), r in sorted(rows.items(), key=lambda kv: kv[0][1]):
            accs.setdefault(config, []).append(r["final_test_acc"] * 100)
        results[regime] = accs
        if merged_dir:
            with open(os.path.join(merged_dir, f"fashion-preset-{regime}.json"), "w") as f:
                json.dump({"regime": regime, "base": REGIMES[regime],
                           "scored_on": "all 10,000 test images, final weights",
                           "runs": sorted(rows.values(), key=lambda r: (r["config"], r["seed"]))},
                          f, indent=1)
        print(f"\n{regime} ({REGIME_TEXT.get(regime, '')})\n\n| configuration | test accuracy, mean ± sd "
              f"(min-max) | seeds | against the paper's recipe |\n|---|---|---|---|")
        for config in ("baseline", *CANDIDATES):
            if config in accs:
                versus = compare(accs[config], accs.get("baseline")) if config != "baseline" else ""
                print(f"| {LABELS[config]} | {summarise(accs[config])} | {len(accs[config])} | {versus} |")
    print("\nThe rule: ahead with t >= 2 in at least half of the regimes, behind with t <= -2 in none.")
    for config in CANDIDATES:
        ts = {regime: welch(a[config], a["baseline"]) for regime, a in results.items() if config in a}
        ahead = [r for r, (_, _, t) in ts.items() if t >= 2]
        behind = [r for r, (_, _, t) in ts.items() if t <= -2]
        gain = statistics.mean(d for d, _, _ in ts.values())
        earns = len(ahead) * 2 >= len(ts) and not behind
        print(f"{LABELS[config]}: ahead (t >= 2) in {ahead or 'none'}, behind (t <= -2) in "
              f"{behind or 'none'}, mean gain {gain:+.2f} points: "
              f"{'earns the name' if earns else 'does not earn the name'}")
    if figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 4.2), sharey=False,
                                 layout="constrained")
        for ax, (regime, accs) in zip(axes, results.items()):
            configs = [c for c in ("baseline", *CANDIDATES) if c in accs]
            for x, config in enumerate(configs):
                values = accs[config]
                spread = [x + 0.06 * (i - (len(values) - 1) / 2) for i in range(len(values))]
                ax.scatter(spread, values, s=14, color="tab:gray", zorder=3)
                mean, sd = statistics.mean(values), statistics.stdev(values)
                ax.errorbar([x + 0.3], [mean], yerr=[sd], fmt="o",
                            color="tab:blue" if config == "baseline" else "tab:orange", capsize=4, zorder=4)
            ax.axhline(statistics.mean(accs["baseline"]), color="tab:blue", linewidth=0.8, linestyle=":")
            ax.set_xticks(range(len(configs)), [LABELS[c].replace(" (", "\n(") for c in configs], fontsize=8)
            ax.set_title(f"{regime}: {REGIME_TEXT.get(regime, '')}", fontsize=10)
            ax.grid(alpha=0.3, axis="y")
        axes[0].set_ylabel("final test accuracy, % (10,000 images)")
        fig.suptitle("WRN-10-2 on Fashion-MNIST: each seed (grey), mean ± sd (colour), per regime")
        fig.savefig(figure, dpi=110)
        print(figure)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/sweep", help="one out-dir per run below this")
    p.add_argument("--json", default=None, help="write every run's result here")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    p.add_argument("--seeds-for", action="append", default=[], help="NAME=N: N seeds for that configuration")
    p.add_argument("--only-seeds", default=None,
                   help="comma-separated seeds: run only these of each configuration's")
    p.add_argument("--regime", choices=sorted(REGIMES), default="short",
                   help="what every run shares (REGIMES)")
    p.add_argument("--configs", default=",".join([*CONFIGS, *DERIVED]),
                   help="comma-separated names (CONFIGS, DERIVED)")
    p.add_argument("--extra", action="append", default=[], help="NAME=FLAGS: another configuration")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    p.add_argument("--report", nargs="+", default=None, metavar="REGIME=JSON[,JSON...]",
                   help="no runs: the tables, the decision rule and the figure from these sweeps' JSON files")
    p.add_argument("--rename", action="append", default=[],
                   help="OLD=NEW: a configuration's name in older files")
    p.add_argument("--figure", default=None, help="--report: the figure's PNG file")
    p.add_argument("--merged", default=None,
                   help="--report: write each regime's runs, merged, to this folder")
    args = p.parse_args()
    if args.report:
        regimes = {item.split("=", 1)[0]: item.split("=", 1)[1].split(",") for item in args.report}
        return report(regimes, dict(r.split("=", 1) for r in args.rename), args.figure, args.merged)
    configs = {name: CONFIGS[name] if name in CONFIGS else DERIVED[name][1]
               for name in args.configs.split(",") if name}
    for extra in args.extra:
        name, flags = extra.split("=", 1)
        configs[name] = flags.split()
    seeds = {name: args.seeds for name in configs}
    seeds.update({name: int(n) for name, n in (item.split("=") for item in args.seeds_for)})
    script = write_script(args.out)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": ROOT}
    rows = []
    for name, flags in configs.items():
        for seed in range(seeds[name]):
            if args.only_seeds is not None and str(seed) not in args.only_seeds.split(","):
                continue
            out = os.path.join(args.out, f"{name}-seed{seed}")
            summary_path = os.path.join(out, "summary.json")
            if name in DERIVED:  # another configuration's weights, scored again
                base = os.path.join(args.out, f"{DERIVED[name][0]}-seed{seed}")
                acc = score_whole_test_set(script, base, env, tuple(flags))
                with open(os.path.join(base, "summary.json")) as f:
                    summary = json.load(f)
                rows.append({"config": name, "flags": flags, "seed": seed, "final_test_acc": acc,
                             "total_time_s": summary["total_time_s"], "out_dir": base})
                print(f"{name} seed {seed}: {acc:.4f}", flush=True)
                continue
            if not os.path.exists(summary_path):
                cmd = [sys.executable, script, "--data-dir", FASHION, *REGIMES[args.regime], *flags, "--seed",
                       str(seed), "--out-dir", out]
                print(" ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            with open(summary_path) as f:
                summary = json.load(f)
            acc = score_whole_test_set(script, out, env)  # with the mirror where the run has --tta
            rows.append({"config": name, "flags": flags, "seed": seed, "final_test_acc": acc,
                         "final_test_acc_on_share": summary["final_test_acc"],
                         "total_time_s": summary["total_time_s"], "out_dir": out})
            print(f"{name} seed {seed}: {acc:.4f} in {summary['total_time_s']:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"regime": args.regime, "base": REGIMES[args.regime], "threads": args.threads,
                       "scored_on": "all 10,000 test images, final weights", "runs": rows}, f, indent=1)
    print("\n| configuration | flags | test accuracy, mean ± sd (min-max) | seeds | against the baseline "
          "| time per run |"
          "\n|---|---|---|---|---|---|")
    accs = {name: [r["final_test_acc"] * 100 for r in rows if r["config"] == name] for name in configs}
    for name, flags in configs.items():
        times = [r["total_time_s"] for r in rows if r["config"] == name]
        print(f"| {name} | `{' '.join(flags) or '(none)'}` | {summarise(accs[name])} | {len(accs[name])} | "
              f"{compare(accs[name], accs.get('baseline'))} | {statistics.mean(times):.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
