#!/bin/bash
# N nodes x G GPUs: srun starts one torchrun per node; they meet through c10d rendezvous on the
# allocation's first node and start G processes each.
#
#   sbatch jobs/multinode.sh                                   # 2 nodes x 4 GPUs
#   sbatch --nodes=4 jobs/multinode.sh --epochs 100 --batch-size 2048
#   CONTAINER=/path/pytorch.sif sbatch jobs/multinode.sh
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
job_summary

# NCCL knobs: uncomment what your cluster needs (see the README's troubleshooting section).
# GPUs on different CPU sockets with broken peer-to-peer (DAIC, some PCIe boxes): hangs at the first all-reduce.
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

# One srun task per node; each runs torchrun, which starts NPROC ranks on its node.
run_requeueable srun --kill-on-bad-exit=1 --ntasks-per-node=1 "${LAUNCH[@]}" \
    torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC" \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
    train_ddp.py "$@"
