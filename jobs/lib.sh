# Shared by the job scripts in jobs/: sourced, not run. What every job needs:
#   RECIPE           the training preset (--recipe wrn-paper: a full WRN-16-8 run), before the script's arguments
#   job_summary      what Slurm granted, printed at the start of the log (print_recipe: the recipe)
#   LAUNCH           the command prefix: empty, or `apptainer exec --nv ...` when CONTAINER is set
#   NPROC, MASTER_ADDR, MASTER_PORT   ranks per node, and where torchrun's ranks meet
#   run_requeueable  run the training, turn Slurm's warning signal into a checkpoint, and requeue
# shellcheck shell=bash disable=SC2034  # LAUNCH, NPROC, MASTER_* are used by the scripts that source this

PROJECT_DIR=${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
DATA_DIR=${DATA_DIR:-$PROJECT_DIR/datasets}
cd "$PROJECT_DIR" || { echo "error: PROJECT_DIR $PROJECT_DIR does not exist" >&2; exit 2; }

job_summary() {
    echo "=== job ${SLURM_JOB_ID:-none} '${SLURM_JOB_NAME:-}' (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname) at $(date -Is)"
    echo "=== nodes: ${SLURM_JOB_NUM_NODES:-1} (${SLURM_JOB_NODELIST:-$(hostname)}); GPUs on this node: ${SLURM_GPUS_ON_NODE:-none};" \
         "CPUs per task: ${SLURM_CPUS_PER_TASK:-?}; time limit: $(squeue -h -j "${SLURM_JOB_ID:-0}" -o %l 2>/dev/null || echo ?)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | sed 's/^/=== GPU /'
        nvidia-smi topo -m 2>/dev/null | head -n 12 | sed 's/^/=== topo /'  # SYS between GPUs: see NCCL_P2P_DISABLE
    fi
    echo "=== project: $PROJECT_DIR; container: ${CONTAINER:-none (current Python environment)}"
}

# The training run's arguments: the recipe, then the job script's own, which override it.
print_recipe() {
    echo "=== recipe: ${RECIPE[*]} (train_ddp.py --help lists what it sets)"
    echo "=== arguments after the script (these win): ${*:-none}"
}

# The training recipe every job script runs, printed at the start of the log: train_ddp.py's preset
# wrn-paper (RECIPES in train_ddp.py: the WRN paper's WRN-16-8 for CIFAR-100, 200 epochs, carried to a
# global batch of 512). train_ddp.py's own defaults are the original script's 5-epoch smoke run.
# Flags after the job script override any value the preset sets, whatever their order:
#   sbatch jobs/multigpu.sh --epochs 100 --batch-size 1024   (the LR follows the batch: 0.8)
RECIPE=(--recipe wrn-paper)

# Apptainer: --nv exposes the GPUs; bind the project and the data so both are visible inside.
LAUNCH=()
if [[ -n "${CONTAINER:-}" ]]; then
    binds="$PROJECT_DIR"
    [[ -d "$DATA_DIR" ]] && binds="$binds,$DATA_DIR"
    LAUNCH=(apptainer exec --nv --bind "$binds" --pwd "$PROJECT_DIR" "$CONTAINER")
fi

# One process per GPU that Slurm granted on each node, never a hard-coded count. Without GPUs
# (a CPU-only partition) set NPROC_PER_NODE; the ranks then train on CPU with gloo.
NPROC=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
# Multi-node rendezvous: on the allocation's first node, on a port derived from the job id so
# that two jobs sharing a node do not collide.
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n 1)
MASTER_PORT=$((20000 + ${SLURM_JOB_ID:-0} % 20000))

# The ranks checkpoint and exit (status 75) when this file appears; it lives in the project
# directory, which every node and the container see. A requeued job keeps its id: start clean.
export DDP_STOP_FILE="$PROJECT_DIR/.ddp-stop-${SLURM_JOB_ID:-local}"
rm -f "$DDP_STOP_FILE"

# Run "$@" in the background so this shell can take Slurm's signals: USR1 (the time-limit warning
# asked for with --signal=B:USR1@...) or TERM (scancel, preemption). On either, ask the ranks to
# checkpoint; once they have stopped, requeue the job, which then resumes from the checkpoint.
run_requeueable() {
    trap 'echo "=== $(date -Is): signal received: asking the ranks to checkpoint and stop"; touch "$DDP_STOP_FILE"' USR1 TERM
    "$@" &
    local pid=$! status=0
    # `wait` returns early whenever a trapped signal arrives: keep waiting until the run has ended.
    while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
    wait "$pid" || status=$?
    trap - USR1 TERM
    if [[ -e "$DDP_STOP_FILE" && $status -ne 0 ]]; then
        rm -f "$DDP_STOP_FILE"
        echo "=== $(date -Is): the run stopped on request (status $status); requeueing job $SLURM_JOB_ID to resume"
        scontrol requeue "$SLURM_JOB_ID" && exit 0
        echo "=== requeue failed (is JobRequeue allowed here?); resubmit this job to resume" >&2
    fi
    rm -f "$DDP_STOP_FILE"
    echo "=== $(date -Is): finished with status $status"
    exit "$status"
}
