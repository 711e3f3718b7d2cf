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
sys.path.insert(0, ROOT)
from config import RECIPES, WRN_PAPER  # noqa: E402 - the project's, from ROOT


def preset_flags(name: str) -> list:
    """The flags a preset adds to the WRN paper's recipe (--recipe modern's options), as a command line."""
    extra = {k: v for k, v in RECIPES[name].items() if k not in WRN_PAPER}
    return [a for k, v in extra.items() for a in (["--" + k.replace("_", "-")] if v is True else
                                                  ["--" + k.replace("_", "-"), str(v)])]


# What every run shares (--regime): "short", a WRN-10-2 on the first 1,000 training images for 24 epochs, batch 64
# at LR 0.05 (0.1 per 128) with the cosine schedule, each epoch scored on the first 2,000 test images, about 50 s
# of training on 2 CPU cores; it still underfits at its end (train loss 0.46, test loss 0.56). "long": the first
# 500 images for 60 epochs, each epoch scored on the first 1,000 test images: a model that fits its few training
# images, the regime where a regulariser can pay (on many images for few epochs a model underfits, and none can).
# The final weights of both are scored on all 10,000 test images: on 1,000, two models of one configuration
# differ by about 0.8 points from which borderline images they happen to get right, as much as an option gains.
REGIMES = {
    "short": ["--depth", "10", "--widen-factor", "2", "--train-size", "1000", "--test-size", "2000", "--epochs", "24",
              "--batch-size", "64", "--base-lr", "0.1", "--reference-batch-size", "128", "--log-every", "0",
              "--target-accuracy", "1.0"],
    "long": ["--depth", "10", "--widen-factor", "2", "--train-size", "500", "--test-size", "1000", "--epochs", "60",
             "--batch-size", "64", "--base-lr", "0.1", "--reference-batch-size", "128", "--log-every", "0",
             "--target-accuracy", "1.0"],
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
    "tta": ["--tta"],  # evaluation only: the baseline's runs scored again (--evaluate --tta), not trained again
    "modern": preset_flags("modern"),  # --recipe modern's options on this regime
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


def score_whole_test_set(script: str, out: str, env: dict, tta: bool = False) -> float:
    """The final weights in `out` scored on all the test images (with the mirror if `tta`), once: cached in out."""
    path = os.path.join(out, "whole-test-tta.json" if tta else "whole-test.json")
    if not os.path.exists(path):
        subprocess.run([sys.executable, script, "--evaluate", "--test-size", "0", "--loader", "gpu", *["--tta"] * tta,
                        "--data-dir", FASHION, "--out-dir", out], env=env, check=True, stdout=subprocess.DEVNULL)
        os.replace(os.path.join(out, "eval.json"), path)
    with open(path) as f:
        result = json.load(f)
    assert result["val_count"] == 10000, path
    return result["val_acc"]


def summarise(accs: list) -> str:
    sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
    return f"{statistics.mean(accs):.2f} ± {sd:.2f} ({min(accs):.2f}-{max(accs):.2f})"


def compare(accs: list, base: list | None) -> str:
    """The difference of the means, its standard error (Welch's, from both spreads) and their ratio, Welch's t."""
    if not base or accs is base or len(accs) < 2 or len(base) < 2:
        return ""
    diff = statistics.mean(accs) - statistics.mean(base)
    se = (statistics.variance(accs) / len(accs) + statistics.variance(base) / len(base)) ** 0.5
    return f"{diff:+.2f} ± {se:.2f} (t = {diff / se:.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/sweep", help="one out-dir per run below this")
    p.add_argument("--json", default=None, help="write every run's result here")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    p.add_argument("--seeds-for", action="append", default=[], help="NAME=N: N seeds for that configuration")
    p.add_argument("--regime", choices=sorted(REGIMES), default="short", help="what every run shares (REGIMES)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names (see CONFIGS)")
    p.add_argument("--extra", action="append", default=[], help="NAME=FLAGS: another configuration")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    args = p.parse_args()
    configs = {name: CONFIGS[name] for name in args.configs.split(",") if name}
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
            out = os.path.join(args.out, f"{name}-seed{seed}")
            summary_path = os.path.join(out, "summary.json")
            if name == "tta":  # the baseline's weights, scored with the mirror
                base = os.path.join(args.out, f"baseline-seed{seed}")
                acc = score_whole_test_set(script, base, env, tta=True)
                with open(os.path.join(base, "summary.json")) as f:
                    summary = json.load(f)
                rows.append({"config": name, "flags": flags, "seed": seed, "final_test_acc": acc,
                             "total_time_s": summary["total_time_s"], "out_dir": base})
                print(f"{name} seed {seed}: {acc:.4f}", flush=True)
                continue
            if not os.path.exists(summary_path):
                cmd = [sys.executable, script, "--data-dir", FASHION, *REGIMES[args.regime], *flags, "--seed", str(seed),
                       "--out-dir", out]
                print(" ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            with open(summary_path) as f:
                summary = json.load(f)
            acc = score_whole_test_set(script, out, env)  # with the mirror where the run has --tta
            rows.append({"config": name, "flags": flags, "seed": seed, "final_test_acc": acc,
                         "final_test_acc_on_share": summary["final_test_acc"], "total_time_s": summary["total_time_s"],
                         "out_dir": out})
            print(f"{name} seed {seed}: {acc:.4f} in {summary['total_time_s']:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"regime": args.regime, "base": REGIMES[args.regime], "threads": args.threads,
                       "scored_on": "all 10,000 test images, final weights", "runs": rows}, f, indent=1)
    print("\n| configuration | flags | test accuracy, mean ± sd (min-max) | seeds | against the baseline | time per run |"
          "\n|---|---|---|---|---|---|")
    accs = {name: [r["final_test_acc"] * 100 for r in rows if r["config"] == name] for name in configs}
    for name, flags in configs.items():
        times = [r["total_time_s"] for r in rows if r["config"] == name]
        print(f"| {name} | `{' '.join(flags) or '(none)'}` | {summarise(accs[name])} | {len(accs[name])} | "
              f"{compare(accs[name], accs.get('baseline'))} | {statistics.mean(times):.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
