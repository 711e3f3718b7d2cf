#!/usr/bin/env bash
# The GPU checklist: what anyone with one or more NVIDIA GPUs runs first, in this order, as one script:
#   1. the GPU tests (the CUDA paths: GPU data path, NCCL, bf16/fp16, --compile, bench.py, --sync-bn)
#   2. the step benchmark on one GPU, against the original script's pipeline (and on all GPUs if several)
#   3. 5-epoch training runs on synthetic data, eager and --compile, logged here
#   4. the README's Fashion-MNIST worked example on the GPUs: its final top-1 and its time
# then prints the rows to paste into bench-results/README.md.
#
#   bash bench-results/gpu_checklist.sh
#   PYTHON=/path/to/python NPROC=2 FASHION_DIR=/data/fashion-mnist bash bench-results/gpu_checklist.sh
#
# It writes bench-results/<gpu>-<date>*.json and *.log (commit the ones you report), and runs/gpu-check-*.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
TORCHRUN=("$PYTHON" -m torch.distributed.run)  # torchrun, from the same environment
command -v nvidia-smi >/dev/null || { echo "error: no nvidia-smi: this checklist needs an NVIDIA GPU" >&2; exit 1; }
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
# "NVIDIA H100 80GB HBM3" -> h100-80gb-hbm3, as the files already here are named
SLUG=$(echo "$GPU_NAME" | tr '[:upper:]' '[:lower:]' | sed -e 's/^nvidia //' -e 's/[^a-z0-9][^a-z0-9]*/-/g' -e 's/^-//' -e 's/-$//')
DATE=$(date +%F)
TAG=bench-results/$SLUG-$DATE
FASHION_DIR=${FASHION_DIR:-/usr/share/datasets/fashion-mnist}
TORCH=$("$PYTHON" -c 'import torch; print(torch.__version__)')
step() { echo; echo "=== $(date -Is) $*"; }

echo "=== $GPU_NAME x $NPROC, torch $TORCH, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); files: $TAG*"

# A leftover checkpoint in an out-dir would be resumed and train nothing: start each run afresh.
rm -rf runs/gpu-check-eager runs/gpu-check-compile runs/gpu-check-fashion

step "1/4 GPU tests (the CUDA paths)"
"$PYTHON" -m pytest tests/gpu -v 2>&1 | tee "$TAG-gpu-tests.log"

step "2/4 step benchmark: 1 GPU, --compile, against the original script's pipeline"
"${TORCHRUN[@]}" --standalone --nproc_per_node=1 bench.py --compile --compare-original --json "$TAG.json" 2>&1 \
    | tee "$TAG-bench.log"
if (( NPROC > 1 )); then  # the same per-GPU batch (512) on every GPU: the scaling efficiency within a node
    "${TORCHRUN[@]}" --standalone --nproc_per_node="$NPROC" bench.py --compile --batch-size $((512 * NPROC)) \
        --json "$TAG-${NPROC}gpu.json" 2>&1 | tee "$TAG-${NPROC}gpu-bench.log"
fi

step "3/4 5-epoch training runs on synthetic data, 1 GPU: eager, then --compile"
"$PYTHON" train_ddp.py --dataset synthetic --epochs 5 --log-every 0 --out-dir runs/gpu-check-eager \
    | tee "$TAG-train-eager.log"
"$PYTHON" train_ddp.py --dataset synthetic --epochs 5 --log-every 0 --compile --out-dir runs/gpu-check-compile \
    | tee "$TAG-train-compile.log"

step "4/4 the README's Fashion-MNIST worked example"
if [[ ! -f "$FASHION_DIR/t10k-labels-idx1-ubyte.gz" && "$FASHION_DIR" == /usr/share/datasets/fashion-mnist ]]; then
    SUDO=(); [[ $EUID -ne 0 ]] && SUDO=(sudo)
    "${SUDO[@]}" apt-get update -qq && "${SUDO[@]}" apt-get install -y -qq dataset-fashion-mnist
fi
[[ -f "$FASHION_DIR/t10k-labels-idx1-ubyte.gz" ]] || { echo "error: no Fashion-MNIST in $FASHION_DIR (set FASHION_DIR)" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# train_ddp.py with load_data replaced by the README's block (as the tests do); the README's command's
# arguments after train_ddp.py, one per line, with this machine's data dir and its own out-dir; and the
# processes: the README runs 2 on CPU, here one per GPU, as many as divide the global batch.
"$PYTHON" - "$WORK" "$FASHION_DIR" "$NPROC" <<'EOF'
import os, re, shlex, sys
work, data_dir, nproc = sys.argv[1], sys.argv[2], int(sys.argv[3])
readme = open("README.md").read()
after = readme.split("<!-- worked example: the tests replace load_data with exactly this block -->", 1)[1]
block, rest = after.split("```python\n", 1)[1].split("```", 1)
command = shlex.split(rest.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " "))
args = command[command.index("train_ddp.py") + 1:]
args[args.index("--data-dir") + 1], args[args.index("--out-dir") + 1] = data_dir, "runs/gpu-check-fashion"
src = open("train_ddp.py").read()
start = src.index("\ndef load_data(") + 1
end = re.compile(r"^\S", re.M).search(src, src.index("\n", start) + 1).start()  # the next top-level line
with open(os.path.join(work, "train_ddp.py"), "w") as f:
    f.write(src[:start] + block.strip("\n") + "\n\n\n" + src[end:])
with open(os.path.join(work, "args"), "w") as f:
    f.write("\n".join(args) + "\n")
batch = int(args[args.index("--batch-size") + 1])
with open(os.path.join(work, "nproc"), "w") as f:
    f.write(str(max(n for n in range(1, nproc + 1) if batch % n == 0)))
EOF
mapfile -t FASHION_ARGS < "$WORK/args"
FASHION_NPROC=$(cat "$WORK/nproc")
echo "torchrun --standalone --nproc_per_node=$FASHION_NPROC train_ddp.py ${FASHION_ARGS[*]} --log-every 0"
START=$(date +%s)
PYTHONPATH=$PWD "${TORCHRUN[@]}" --standalone --nproc_per_node="$FASHION_NPROC" "$WORK/train_ddp.py" \
    "${FASHION_ARGS[@]}" --log-every 0 | tee "$TAG-fashion-mnist.log"
FASHION_WALL=$(( $(date +%s) - START ))

step "done: rows for bench-results/README.md"
"$PYTHON" - "$TAG" "$DATE" "$GPU_NAME" "$TORCH" "$NPROC" "$FASHION_NPROC" "$FASHION_WALL" <<'EOF'
import json, os, sys
tag, date, gpu, torch_version, nproc, fashion_nproc, fashion_wall = sys.argv[1:]
nproc, where = int(nproc), f"{gpu}, torch {torch_version}"
def metrics(run):
    with open(os.path.join("runs", run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
def mean_ips(rows):  # the epochs after the first (which holds the warm-up, and with --compile the compilation)
    later = rows[1:] or rows
    return sum(r["images_per_s"] for r in later) / len(later)

with open(f"{tag}-gpu-tests.log") as f:  # pytest's last line: "=== 6 passed, 1 skipped in 180.12s ==="
    result = [line.strip("= \n") for line in f if " passed" in line or " failed" in line][-1:] or ["see the log"]
print("GPU tests:")
print(f"| {date} | {where} | {result[0]} | `{tag}-gpu-tests.log` |")
r = json.load(open(f"{tag}.json"))
ours = r["ours"]
orig = r.get("original") or r.get("seed") or {}
ratio = f"{ours['images_per_s'] / orig['images_per_s']:.2f}x" if orig.get("images_per_s") else "n/a"
mfu = "n/a" if ours.get("mfu") is None else f"{ours['mfu'] * 100:.1f}%"
mem = "n/a" if ours.get("peak_memory_gib") is None else f"{ours['peak_memory_gib']:.1f} GiB"
print("\nStep benchmark:")
print(f"| {date} | {where} | **{ours['images_per_s']:,.0f}** | {ours['step_s'] * 1e3:.1f} ms ({ours.get('phases', ours)['data_s'] * 1e3:.2f} ms) "
      f"| {mfu} | {mem} | {orig.get('images_per_s', 0):,.0f} | **{ratio}** | {ours['augment_epoch_s'] * 1e3:.1f} ms | `{tag}.json` |")
if nproc > 1:
    m = json.load(open(f"{tag}-{nproc}gpu.json"))["ours"]
    print("\nScaling within a node (same per-GPU batch, 512):")
    print(f"| {date} | {where} | {nproc} | {m['images_per_s']:,.0f} | {m['images_per_s_per_gpu']:,.0f} "
          f"| {m['images_per_s_per_gpu'] / ours['images_per_s']:.0%} | `{tag}-{nproc}gpu.json` |")
print("\nTraining runs (epochs 2-5, 1 GPU):")
for run, name in (("gpu-check-eager", "eager"), ("gpu-check-compile", "--compile")):
    rows = metrics(run)
    print(f"| {date} | {where} | {name} | **{mean_ips(rows):,.0f}** | {rows[0]['epoch_time_s']:.1f} s | `{tag}-train-{name.strip('-')}.log` |")
rows = metrics("gpu-check-fashion")
train_s = sum(row["epoch_time_s"] for row in rows)
print("\nFashion-MNIST worked example:")
print(f"| {date} | {where} | {fashion_nproc} GPU(s) | **{rows[-1]['val_acc'] * 100:.1f}%** after {len(rows)} epochs "
      f"| {train_s:.0f} s of training, {fashion_wall} s wall | `{tag}-fashion-mnist.log` |")
EOF
