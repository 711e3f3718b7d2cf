#!/bin/bash
# Preflight on the nodes and GPUs a real job will get: the network between the nodes, GPU-to-rank
# mapping, versions, data and out-dir on every node, all-reduce bandwidth, NCCL hints. A few
# minutes, before a long job.
#
#   sbatch jobs/preflight.sh --data-dir ./datasets --out-dir ./runs/wrn
#   sbatch --nodes=2 jobs/preflight.sh                    # check the interconnect too
#SBATCH --job-name=wrn_preflight
#SBATCH --output=preflight_%j.out
#SBATCH --error=preflight_%j.err
#SBATCH --time=00:10:00
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
##SBATCH --account=<project>
##SBATCH --partition=<gpu partition>

set -uo pipefail
# shellcheck source=jobs/lib.sh
source "${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-.}}/jobs/lib.sh"
job_summary

# The network first, one task per node and no torchrun: every node reaches the rendezvous address
# (the first node listens there), and NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name a usable interface.
# A failure here names its cause within --timeout, where torchrun would wait for its own timeout.
srun --ntasks-per-node=1 "${LAUNCH[@]}" python preflight.py --network "$MASTER_ADDR:$MASTER_PORT" "$@" || exit 1

# Same launch as jobs/multinode.sh, so what passes here is what training will meet.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 "${LAUNCH[@]}" \
    torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC" \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
    preflight.py "$@"
