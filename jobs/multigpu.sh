#!/bin/bash
# One node, N GPUs: torchrun --standalone starts one process per GPU that Slurm granted.
#
#   sbatch jobs/multigpu.sh                                     # a full WRN-16-8 run (--recipe wrn-paper)
#   sbatch --gpus=2 --time=00:30:00 jobs/multigpu.sh --epochs 30  # any #SBATCH line, overridden
#   CONTAINER=/path/pytorch.sif sbatch jobs/multigpu.sh         # inside Apptainer (see jobs/wrn-ddp.def)
#
# Arguments after the script go to train_ddp.py after the recipe, so they override it. Submit from the
# project directory (or set PROJECT_DIR): the log, the data (./datasets) and the runs (./runs) are relative
# to it.
#SBATCH --job-name=wrn_multigpu
#SBATCH --output=multigpu_%j.out
#SBATCH --error=multigpu_%j.err
#SBATCH --time=01:00:00
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=128G
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
# Most sites also want these; uncomment and fill in:
##SBATCH --account=<project>
##SBATCH --partition=<gpu partition>

set -uo pipefail
# sbatch runs a copy of this script from a spool directory: find lib.sh from the submit directory.
# shellcheck source=jobs/lib.sh
source "${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-.}}/jobs/lib.sh"
job_preamble "$@"  # lib.sh: what Slurm granted, the recipe, torch's GPUs, NCCL's flight recorder

# NPROC (lib.sh): one process per GPU that Slurm granted on this node.
echo "=== torchrun: 1 node x $NPROC processes"

run_requeueable "${LAUNCH[@]}" torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" \
    train_ddp.py "${RECIPE[@]}" "$@"
