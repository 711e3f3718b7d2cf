#!/bin/bash
# N nodes x G GPUs: srun starts one torchrun per node; they meet through c10d rendezvous on the
# allocation's first node and start G processes each.
#
#   sbatch jobs/multinode.sh                                   # 2 nodes x 4 GPUs, the full recipe
#                                                              # (--recipe wrn-paper)
#   sbatch --nodes=4 jobs/multinode.sh --epochs 100 --batch-size 2048
#   CONTAINER=/path/pytorch.sif sbatch jobs/multinode.sh
#   MIN_NODES=1 sbatch --no-kill jobs/multinode.sh             # elastic: survive losing nodes (below)
#SBATCH --job-name=wrn_multinode
#SBATCH --output=multinode_%j.out
#SBATCH --error=multinode_%j.err
#SBATCH --time=01:00:00
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=128G
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
##SBATCH --account=<project>
##SBATCH --partition=<gpu partition>

set -uo pipefail
# shellcheck source=jobs/lib.sh
source "${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-.}}/jobs/lib.sh"
job_preamble "$@"  # lib.sh: what Slurm granted, the recipe, torch's GPUs, NCCL's flight recorder

# NCCL knobs: uncomment what your cluster needs (see docs/troubleshooting.md).
# GPUs on different CPU sockets with broken peer-to-peer (DAIC, some PCIe boxes): hangs at the first
# all-reduce.
# export NCCL_P2P_DISABLE=1
# Pin NCCL's bootstrap and socket traffic to the fast interface when nodes have several (ib0, eth0, ...).
# export NCCL_SOCKET_IFNAME=ib0
# Print what NCCL chose (transport, rings, interfaces): the first thing to read when it hangs or crawls.
# export NCCL_DEBUG=INFO
# InfiniBand: pick the HCAs (ibstat lists them), or switch IB off to test whether it is the culprit.
# export NCCL_IB_HCA=mlx5_0,mlx5_1
# export NCCL_IB_DISABLE=1

# lib.sh set the rendezvous: MASTER_ADDR is the allocation's first node (scontrol show hostnames),
# MASTER_PORT is derived from the job id; NPROC is the GPUs granted per node.
echo "=== torchrun: $SLURM_JOB_NUM_NODES nodes x $NPROC processes, rendezvous at $MASTER_ADDR:$MASTER_PORT"

# torchrun shares its rendezvous store with the ranks by default, and each node counts its own
# restarts, so after one node's restart (or a node joining) the nodes can wait for each other in
# different namespaces for ever (pytorch/pytorch#135712). Without sharing, rank 0 hosts a fresh
# store for every round of the rendezvous.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# Elastic (MIN_NODES < the job's nodes): when a node dies, torchrun restarts the survivors at the
# smaller world size, and they resume from the last checkpoint with more accumulation steps (same
# global batch, same LR schedule); the steps since that checkpoint are lost. Slurm must let the job
# outlive the node: submit with `sbatch --no-kill`, and srun must neither kill the step nor the other
# tasks when one task dies (--no-kill, --kill-on-bad-exit=0). The rendezvous runs on the first node:
# losing that one ends the job. Set --checkpoint-every to bound what a loss costs.
NODES=("--nnodes=$SLURM_JOB_NUM_NODES")
SRUN_FAILURE=(--kill-on-bad-exit=1)
if [[ -n "${MIN_NODES:-}" && "$MIN_NODES" -lt "$SLURM_JOB_NUM_NODES" ]]; then
    NODES=("--nnodes=$MIN_NODES:$SLURM_JOB_NUM_NODES" "--max-restarts=${MAX_RESTARTS:-3}")
    SRUN_FAILURE=(--no-kill --kill-on-bad-exit=0)
    echo "=== elastic: keeps training on $MIN_NODES to $SLURM_JOB_NUM_NODES nodes," \
         "up to ${MAX_RESTARTS:-3} restarts"
fi

# One srun task per node; each runs torchrun, which starts NPROC ranks on its node.
run_requeueable srun "${SRUN_FAILURE[@]}" --ntasks-per-node=1 "${LAUNCH[@]}" \
    torchrun "${NODES[@]}" --nproc_per_node="$NPROC" \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
    train_ddp.py "${RECIPE[@]}" "$@"
