#!/bin/bash
# No torchrun: srun starts one task per GPU, and train_ddp.py reads its rank, local rank and world
# size from SLURM_PROCID, SLURM_LOCALID and SLURM_STEP_NUM_TASKS, and the master from the
# allocation. Works on one node or several.
#
#   sbatch jobs/srun_direct.sh                      # the full recipe (--recipe wrn-paper)
#   sbatch --nodes=2 jobs/srun_direct.sh --epochs 30
#SBATCH --job-name=wrn_srun
#SBATCH --output=srun_%j.out
#SBATCH --error=srun_%j.err
#SBATCH --time=01:00:00
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8
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

# One thread per CPU the task was given: without torchrun (which sets 1 for several ranks) torch starts a
# thread per core of the node in each task where Slurm binds none, and the node's tasks fight for them.
# (lib.sh passes --cpus-per-task on to srun.)
if [[ -n "${OMP_NUM_THREADS:-}" ]]; then
    threads_from="OMP_NUM_THREADS, set before the job"
elif [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK
    threads_from="--cpus-per-task $SLURM_CPUS_PER_TASK"
else
    export OMP_NUM_THREADS=1
    threads_from="no --cpus-per-task given: 1"
fi
echo "=== threads per task: $OMP_NUM_THREADS ($threads_from)"

# Every task sees all of its node's GPUs, so that LOCAL_RANK picks the GPU (some clusters bind
# each task to one GPU by default, which would leave every rank asking for GPU local_rank).
run_requeueable srun --kill-on-bad-exit=1 --gpu-bind=none "${LAUNCH[@]}" \
    python train_ddp.py "${RECIPE[@]}" "$@"
