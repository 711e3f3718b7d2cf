#!/bin/bash
# Scaling benchmark: bench.py on 1, 2, 4, ... GPUs of this allocation (one node), then on all
# nodes, at a fixed per-GPU batch, each result a JSON file; then the plot.
#
#   sbatch jobs/scaling.sh                      # 1 node: 1, 2, 4 GPUs
#   sbatch --nodes=4 jobs/scaling.sh            # then also 2 and 4 nodes x all GPUs
#   PER_GPU_BATCH=256 sbatch jobs/scaling.sh -- --compile
#   COMM_HOOKS="none bf16 powersgd" sbatch --nodes=4 jobs/scaling.sh   # each size with each --comm-hook
#SBATCH --job-name=wrn_scaling
#SBATCH --output=scaling_%j.out
#SBATCH --error=scaling_%j.err
#SBATCH --time=01:00:00
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=128G
##SBATCH --account=<project>
##SBATCH --partition=<gpu partition>

set -uo pipefail
# shellcheck source=jobs/lib.sh
source "${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-.}}/jobs/lib.sh"
job_summary

GPUS=$NPROC  # lib.sh: the GPUs granted per node
PER_GPU_BATCH=${PER_GPU_BATCH:-512}
OUT=${SCALING_DIR:-$PROJECT_DIR/bench-results/$SLURM_JOB_ID}
mkdir -p "$OUT"
[[ "${1:-}" == "--" ]] && shift  # extra bench.py arguments follow

for hook in ${COMM_HOOKS:-none}; do  # DDP's communication hooks (--comm-hook): a curve each
    name=""
    [[ "$hook" != none ]] && name="-$hook"
    n=1
    while (( n <= GPUS )); do  # one node, n GPUs
        "${LAUNCH[@]}" torchrun --standalone --nproc_per_node="$n" bench.py --comm-hook "$hook" \
            --batch-size $((PER_GPU_BATCH * n)) --json "$OUT/1x$n$name.json" "$@"
        n=$((n * 2))
    done
    nodes=2
    while (( nodes <= SLURM_JOB_NUM_NODES )); do  # several nodes, all GPUs
        port=$((20000 + (SLURM_JOB_ID + nodes) % 20000))
        srun --nodes="$nodes" --ntasks-per-node=1 "${LAUNCH[@]}" \
            torchrun --nnodes="$nodes" --nproc_per_node="$GPUS" --rdzv_id="$SLURM_JOB_ID-$nodes$name" \
            --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$port" \
            bench.py --comm-hook "$hook" --batch-size $((PER_GPU_BATCH * GPUS * nodes)) \
            --json "$OUT/${nodes}x$GPUS$name.json" "$@"
        nodes=$((nodes * 2))
    done
done
"${LAUNCH[@]}" python plot.py --scaling "$OUT"/*.json --out "$OUT" || echo "plotting skipped (pip install matplotlib)"
echo "=== results in $OUT"
