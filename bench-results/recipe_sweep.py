"""The modern recipe's options measured on real data: Fashion-MNIST (Debian's dataset-fashion-mnist), each
configuration over several seeds, one process at a time, final-epoch test accuracy and time.

    .venv/bin/python bench-results/recipe_sweep.py --out runs/sweep --json bench-results/fashion-recipe.json

It copies train_ddp.py with load_data replaced by the README's Fashion-MNIST block (as the tests do), runs
every (configuration, seed) that has no summary.json yet under --out (so a stopped sweep resumes), and prints
the table bench-results/README.md holds: per configuration the final-epoch test accuracy's mean, sample
standard deviation and range over the seeds, and the mean training time. plot.py draws the runs' curves.
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

# What every run shares (--regime): "short", a WRN-10-2 on the first 1,000 training images for 24 epochs, batch 64
# at LR 0.05 (0.1 per 128) with the cosine schedule, scored on the first 2,000 test images, about 50 s of training
# on 2 CPU cores; it still underfits at its end (train loss 0.46, test loss 0.56). "long": the first 500 images
# for 60 epochs, scored on the first 1,000 test images: a model that fits its few training images, the regime
# where a regulariser can pay (on many images for few epochs a model underfits, and none can).
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/sweep", help="one out-dir per run below this")
    p.add_argument("--json", default=None, help="write every run's result here")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    p.add_argument("--regime", choices=sorted(REGIMES), default="short", help="what every run shares (REGIMES)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names (see CONFIGS)")
    p.add_argument("--extra", action="append", default=[], help="NAME=FLAGS: another configuration")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    args = p.parse_args()
    configs = {name: CONFIGS[name] for name in args.configs.split(",") if name}
    for extra in args.extra:
        name, flags = extra.split("=", 1)
        configs[name] = flags.split()
    script = write_script(args.out)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": ROOT}
    rows = []
    for name, flags in configs.items():
        for seed in range(args.seeds):
            out = os.path.join(args.out, f"{name}-seed{seed}")
            summary_path = os.path.join(out, "summary.json")
            if name == "tta":  # the baseline's weights, scored with the mirror
                base = os.path.join(args.out, f"baseline-seed{seed}")
                subprocess.run([sys.executable, script, "--evaluate", "--tta", "--data-dir", FASHION, "--out-dir", base],
                               env=env, check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(base, "eval.json")) as f, open(os.path.join(base, "summary.json")) as g:
                    acc, summary = json.load(f)["val_acc"], json.load(g)
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
            rows.append({"config": name, "flags": flags, "seed": seed, "final_test_acc": summary["final_test_acc"],
                         "total_time_s": summary["total_time_s"], "out_dir": out})
            print(f"{name} seed {seed}: {summary['final_test_acc']:.4f} in {summary['total_time_s']:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"regime": args.regime, "base": REGIMES[args.regime], "threads": args.threads, "runs": rows}, f, indent=1)
    print("\n| configuration | flags | test accuracy, mean ± sd (min-max) | seeds | time per run |\n|---|---|---|---|---|")
    for name, flags in configs.items():
        accs = [r["final_test_acc"] * 100 for r in rows if r["config"] == name]
        times = [r["total_time_s"] for r in rows if r["config"] == name]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"| {name} | `{' '.join(flags) or '(none)'}` | {statistics.mean(accs):.2f} ± {sd:.2f} "
              f"({min(accs):.2f}-{max(accs):.2f}) | {len(accs)} | {statistics.mean(times):.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
