"""--comm-hook's effect on learning, on real data: the README's Fashion-MNIST example (2 processes, WRN-10-1, batch
128, 3 epochs of all 60,000 images) with each hook given, over several seeds, one run at a time.

    .venv/bin/python bench-results/comm_hooks_fashion.py --hooks none fp16 --seeds 0 1 2 \
        --out runs/comm-hooks --json bench-results/comm-hooks-fashion.json

It copies train_ddp.py with load_data replaced by the README's block (recipe_sweep.write_script, as the tests do),
runs every (hook, seed) that has no summary.json yet under --out (a stopped sweep resumes), and prints, per hook,
the final test accuracy's mean, sample standard deviation and range over the seeds, the difference of the means
against the first hook with its standard error, and the mean training time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recipe_sweep import FASHION, compare, summarise, write_script  # noqa: E402

# The README's command (README.md, "Worked example: Fashion-MNIST")
README_RUN = ["--data-dir", FASHION, "--depth", "10", "--widen-factor", "1", "--batch-size", "128", "--base-lr", "0.1",
              "--reference-batch-size", "128", "--epochs", "3", "--log-every", "0"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hooks", nargs="+", default=["none", "fp16"], help="the --comm-hook values, the first the base")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun --nproc_per_node)")
    p.add_argument("--out", default="runs/comm-hooks", help="a folder per (hook, seed), and the script")
    p.add_argument("--json", default=None, help="also write the runs and the table here")
    args = p.parse_args()
    script = write_script(args.out)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}  # this project's
    runs = []
    for hook in args.hooks:
        for seed in args.seeds:
            out = os.path.join(args.out, f"{hook}-seed{seed}")
            if not os.path.exists(os.path.join(out, "summary.json")):
                subprocess.run([torchrun, "--standalone", f"--nproc_per_node={args.nproc}", script, *README_RUN,
                                "--comm-hook", hook, "--seed", str(seed), "--out-dir", out], check=True,
                               stdout=subprocess.DEVNULL, env=env)
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                metrics = [json.loads(line) for line in f]
            runs.append({"hook": hook, "seed": seed, "final_test_acc": summary["final_val_acc"] * 100,
                         "train_time_s": sum(m["epoch_time_s"] for m in metrics)})
            print(f"{hook} seed {seed}: {runs[-1]['final_test_acc']:.2f}% in {runs[-1]['train_time_s']:.0f} s",
                  flush=True)
    table = ["| --comm-hook | final test top-1 % (mean ± sd, range) | against " + args.hooks[0] +
             " | training time |", "|---|---|---|---|"]
    accs = {hook: [r["final_test_acc"] for r in runs if r["hook"] == hook] for hook in args.hooks}
    for hook in args.hooks:
        time_s = statistics.mean(r["train_time_s"] for r in runs if r["hook"] == hook)
        table.append(f"| {hook} | {summarise(accs[hook])} | {compare(accs[hook], accs[args.hooks[0]]) or '-'} | "
                     f"{time_s:.0f} s |")
    print("\n".join(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": README_RUN, "nproc": args.nproc, "runs": runs, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
