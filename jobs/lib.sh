# Shared by the job scripts in jobs/: sourced, not run. What every job needs:
#   RECIPE           the training preset (--recipe wrn-paper: a full WRN-16-8 run), before the script's
#                    arguments
#   job_summary      what Slurm granted, printed at the start of the log (print_recipe: the recipe)
#   job_preamble     a training job's start: job_summary, print_recipe, check_cuda, flight_recorder
#   LAUNCH           the command prefix: empty, or `apptainer exec --nv ...` when CONTAINER is set
#   NPROC, MASTER_ADDR, MASTER_PORT   ranks per node, and where torchrun's ranks meet
#   run_requeueable  run the training; Slurm's signals checkpoint it, then USR1 requeues and TERM ends the job
#   stage_data       STAGE_DATA=data.tar: the data copied once to each node's local disk, and trained on there
# shellcheck shell=bash disable=SC2034  # LAUNCH, NPROC, MASTER_* are used by the scripts that source this

PROJECT_DIR=${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
DATA_DIR_GIVEN=${DATA_DIR:+yes}  # DATA_DIR=... sbatch ...: the data's dir, for train_ddp.py and the container
DATA_DIR=${DATA_DIR:-$PROJECT_DIR/datasets}
cd "$PROJECT_DIR" || { echo "error: PROJECT_DIR $PROJECT_DIR does not exist" >&2; exit 2; }

job_summary() {
    echo "=== job ${SLURM_JOB_ID:-none} '${SLURM_JOB_NAME:-}' (restart ${SLURM_RESTART_COUNT:-0})" \
         "on $(hostname) at $(date -Is)"
    echo "=== nodes: ${SLURM_JOB_NUM_NODES:-1} (${SLURM_JOB_NODELIST:-$(hostname)});" \
         "GPUs on this node: ${SLURM_GPUS_ON_NODE:-none}; CPUs per task: ${SLURM_CPUS_PER_TASK:-?};" \
         "time limit: $(squeue -h -j "${SLURM_JOB_ID:-0}" -o %l 2>/dev/null || echo ?)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | sed 's/^/=== GPU /'
        # SYS between GPUs: see NCCL_P2P_DISABLE
        nvidia-smi topo -m 2>/dev/null | head -n 12 | sed 's/^/=== topo /'
    fi
    local python="in the container"
    [[ -z "${CONTAINER:-}" ]] && python=$(command -v python || echo none)
    echo "=== project: $PROJECT_DIR; container: ${CONTAINER:-none}; python: $python"
}

# The training run's arguments: the recipe, then the job script's own, which override it.
print_recipe() {
    echo "=== recipe: ${RECIPE[*]} (train_ddp.py --help lists what it sets)"
    echo "=== arguments after the script (these win): ${*:-none}"
    echo "=== the global batch and LR it trains with: the 'Global batch ... LR ...' line below"
}

# The training recipe every job script runs, printed at the start of the log: train_ddp.py's preset
# wrn-paper (RECIPES in train_utils.py: the WRN paper's WRN-16-8 for CIFAR-100, 200 epochs, carried to a
# global batch of 512). train_ddp.py's own defaults are the original script's 5-epoch smoke run.
# Flags after the job script override any value the preset sets, whatever their order:
#   sbatch jobs/multigpu.sh --epochs 100 --batch-size 1024   (the LR follows the batch: 0.8)
RECIPE=(--recipe wrn-paper)
[[ -n "$DATA_DIR_GIVEN" ]] && RECIPE+=(--data-dir "$DATA_DIR")  # a --data-dir after the script still wins

# The value of train_ddp.py's flag $1 in the arguments after it (the last one given wins), else $2.
flag_value() {
    local name=$1 value=$2 prev=""
    shift 2
    for arg in "$@"; do
        [[ "$prev" == "$name" ]] && value=$arg
        [[ "$arg" == "$name"=* ]] && value=${arg#"$name"=}
        prev=$arg
    done
    echo "$value"
}

# Apptainer: --nv exposes the GPUs; bind the project, the data and the out-dir (the script's own arguments,
# which sourcing sees) where they lie outside it, so that all are visible inside.
LAUNCH=()
binds="$PROJECT_DIR"
if [[ -n "${CONTAINER:-}" ]]; then
    for dir in "$(flag_value --data-dir "$DATA_DIR" "$@")" "$(flag_value --out-dir runs "$@")"; do
        [[ "$dir" == /* && "$dir" != "$PROJECT_DIR"/* ]] || continue  # relative: inside the project
        mkdir -p "$dir" 2>/dev/null  # the out-dir may not exist yet; a bind needs it
        [[ -d "$dir" ]] && binds="$binds,$dir"
    done
    LAUNCH=(apptainer exec --nv --bind "$binds" --pwd "$PROJECT_DIR" "$CONTAINER")
fi

# The Python environment: the container's when CONTAINER is set; else the one VENV names, or the project's
# .venv when it exists (the README's set-up makes it), first on PATH; else whatever is on PATH. Without a
# torchrun there, stop now in one line, not halfway through the job.
if [[ -z "${CONTAINER:-}" ]]; then
    VENV=${VENV:-$PROJECT_DIR/.venv}
    [[ -x "$VENV/bin/python" ]] && export PATH="$VENV/bin:$PATH"
    if ! command -v torchrun >/dev/null 2>&1; then
        echo "error: no torchrun on PATH and no Python environment in $VENV: activate the environment" \
             "that has torch before sbatch (or load its module), set VENV=/path/to/venv, or" \
             "CONTAINER=/path/to/image.sif" >&2
        exit 2
    fi
fi

# Slurm granted GPUs, but the environment's torch may see none (a CPU-only build, a CUDA module not loaded,
# a container without --nv): stop in one line rather than train on the CPU for days, unless the training
# flags ("$@") ask for the CPU with --device cpu.
check_cuda() {
    local granted=${SLURM_GPUS_ON_NODE:-0} out seen python version count
    [[ "$granted" =~ ^[0-9]+$ && "$granted" -gt 0 ]] || return 0
    [[ " $* " == *" --device cpu "* || " $* " == *" --device=cpu "* ]] && return 0
    # One marked line on stdout; torch's warnings (an old driver, say) go to stderr and are not parsed.
    out=$(${LAUNCH[@]+"${LAUNCH[@]}"} python -c "import sys, torch
print('torch-check', sys.executable, torch.__version__, torch.cuda.device_count())" 2>&1)
    seen=$(grep '^torch-check ' <<< "$out")
    if [[ -z "$seen" ]]; then
        local where="this job's Python environment"
        local fix="activate the environment that has torch before sbatch, set VENV=/path/to/venv, or"
        fix+=" CONTAINER=/path/to/image.sif"
        [[ -n "${CONTAINER:-}" ]] && where="the container $CONTAINER" fix="use an image that has torch"
        echo "error: torch does not import in $where (${out##*$'\n'}): $fix" >&2
        exit 2
    fi
    read -r _ python version count <<< "$seen"
    if [[ "$count" == 0 ]]; then
        echo "error: Slurm granted $granted GPUs on $(hostname), but torch $version in $python sees none" \
             "(a CPU-only torch build, a CUDA module not loaded, or a container run without --nv): fix the" \
             "environment, or add --device cpu to train on the CPU" >&2
        exit 2
    fi
}

# One process per GPU that Slurm granted on each node, never a hard-coded count. Without GPUs
# (a CPU-only partition) set NPROC_PER_NODE; the ranks then train on CPU with gloo.
NPROC=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
# Multi-node rendezvous: on the allocation's first node, on a port derived from the job id so
# that two jobs sharing a node do not collide.
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n 1)
MASTER_PORT=$((20000 + ${SLURM_JOB_ID:-0} % 20000))
# srun inside the job gets the job's CPUs per task: since Slurm 22.05 it no longer takes --cpus-per-task from
# sbatch, and a task bound to 1 CPU would run torchrun, its ranks and their loader workers on that one CPU.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK="${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}"
fi

# A collective that times out on NCCL (a rank hung or gone) makes every rank dump its flight recorder: its
# last collectives, which ones completed, and where it waited, into the out-dir's nccl_trace/, one file per
# rank; `torchfrtrace <out-dir>/nccl_trace` then names the ranks that did not arrive. The ranks' own line
# names them too where the store can tell (gloo). "$@": the training flags, for --out-dir (a --recipe that
# sets its own out-dir is not seen here: its dumps go to ./runs/wrn/nccl_trace).
flight_recorder() {
    local granted=${SLURM_GPUS_ON_NODE:-0}
    [[ "$granted" =~ ^[0-9]+$ && "$granted" -gt 0 ]] || return 0  # no GPUs: no NCCL (gloo's line names them)
    local dir
    dir="$(flag_value --out-dir ./runs/wrn "$@")/nccl_trace"  # train_ddp.py's default out-dir
    mkdir -p "$dir" 2>/dev/null || return 0  # the run itself will say what is wrong with the out-dir
    export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
    export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
    export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
    # older torch's name
    export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$dir/rank_}
    export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$dir/rank_}
    echo "=== on a collective timeout, NCCL's flight recorder dumps into $dir (read them: torchfrtrace $dir)"
}

# STAGE_DATA=/shared/path/data.tar (a tar, compressed or not) or a folder: before training, one task per node
# copies or extracts it into the node's local disk ($SLURM_TMPDIR, else LOCAL_DATA_DIR), and the run reads that
# copy (--data-dir: what the tar or folder holds at its top, train/ and test/ say). Worth it for many small files on
# shared storage (an image folder), which each epoch would read over the network; not for data read once into
# memory (CIFAR-100's archive). Each node removes its copy when the job ends (a requeued job stages again).
# Too little free space, or an archive that does not extract, ends the job before training, in one line.
stage_data() {
    [[ -n "${STAGE_DATA:-}" ]] || return 0
    local local_dir=${SLURM_TMPDIR:-${LOCAL_DATA_DIR:-}} nodes size
    if [[ -z "$local_dir" ]]; then
        echo "error: STAGE_DATA is set, but there is no node-local directory to stage into: this cluster sets" \
             "no SLURM_TMPDIR; set LOCAL_DATA_DIR to the nodes' local disk (/tmp, /localscratch, ...), or" \
             "unset STAGE_DATA" >&2
        exit 2
    fi
    if [[ -n "$DATA_DIR_GIVEN" || -n "$(flag_value --data-dir "" "$@")" ]]; then
        echo "error: STAGE_DATA and a data directory (DATA_DIR, --data-dir) are both given: the job trains on" \
             "the staged copy of STAGE_DATA; give one of them" >&2
        exit 2
    fi
    if [[ -d "$STAGE_DATA" ]]; then
        size=$(du -s --block-size=1 "$STAGE_DATA" | cut -f1)  # on disk: small files take a block each
    elif [[ -f "$STAGE_DATA" && -r "$STAGE_DATA" ]]; then
        size=$(stat -c %s "$STAGE_DATA")
    else
        echo "error: STAGE_DATA $STAGE_DATA is not a readable file or folder (run from $PROJECT_DIR): give" \
             "the tar or folder of the data on shared storage" >&2
        exit 2
    fi
    STAGED_DIR="$local_dir/ddp-data-${SLURM_JOB_ID:-local}"
    nodes=${SLURM_JOB_NUM_NODES:-1}
    echo "=== staging STAGE_DATA $STAGE_DATA ($size bytes) into $STAGED_DIR, once on each of $nodes node(s)"
    local step=(srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1) report status=0 reason
    report="$PROJECT_DIR/.ddp-stage-${SLURM_JOB_ID:-local}"  # where a node says why it failed
    rm -f "$report".*
    "${step[@]}" bash "$PROJECT_DIR/jobs/stage_node.sh" "$STAGE_DATA" "$STAGED_DIR" "$size" "$report" || status=$?
    if [[ $status -ne 0 ]]; then
        reason=$(cat "$report".* 2>/dev/null | head -n 1)
        rm -f "$report".*
        "${step[@]}" rm -rf "$STAGED_DIR"  # the nodes that staged their copy
        echo "error: staging failed on ${reason:-a node (srun exited $status: its lines above say why)}" >&2
        exit 2
    fi
    # Each node's copy goes at the run's end (end_staging), or when Slurm signals this step's tasks (scancel, the time
    # limit), which wait for the node's ranks to leave it (stage_node.sh). --overlap shares the job's CPUs, memory and
    # GPUs with the training step (Slurm 22.05 on), which still gets them all.
    "${step[@]}" --overlap --job-name="$STAGE_STEP" bash "$PROJECT_DIR/jobs/stage_node.sh" --remove "$STAGED_DIR" &
    STAGE_CLEANUP=$!
    # the copy, or the one folder a tar of the folder itself holds (tar -cf digits.tar digits): what each node printed
    RECIPE+=(--data-dir "$(bash "$PROJECT_DIR/jobs/stage_node.sh" --data-dir "$STAGED_DIR")")
    [[ -n "${CONTAINER:-}" ]] && LAUNCH=(apptainer exec --nv --bind "$binds,$local_dir" --pwd "$PROJECT_DIR"
                                          "$CONTAINER")
    return 0
}

STAGE_STEP=ddp-staged-copy STAGE_CLEANUP=""  # the cleanup step's name, and its srun's pid while it runs

# The staged copies removed before the run's last line, so that both logs end with that line: the cleanup step's
# tasks get a HUP (a TERM would be logged as the step's cancellation), remove their node's copy and end the step
# before the job ends (else Slurm cancels it then, and srun's and slurmstepd's lines come after the run's).
end_staging() {
    [[ -n "$STAGE_CLEANUP" ]] || return 0
    local id="" tries=0
    while [[ -z "$id" ]] && kill -0 "$STAGE_CLEANUP" 2>/dev/null && (( tries++ < 60 )); do  # once Slurm lists it
        id=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk -v n="$STAGE_STEP" '$2 == n {print $1}')
        [[ -n "$id" ]] || sleep 0.5
    done
    [[ -n "$id" ]] && scancel --signal=HUP "$id" 2>/dev/null && wait "$STAGE_CLEANUP" 2>/dev/null
    STAGE_CLEANUP=""
}

# The start of every training job (multigpu.sh, multinode.sh, srun_direct.sh), one call so that they stay
# alike. "$@": the training flags.
job_preamble() {
    job_summary
    print_recipe "$@"
    check_cuda "$@"  # GPUs granted but unseen by torch: stop now, in one line
    flight_recorder "$@"  # a collective timeout leaves each rank's last collectives in the out-dir
    stage_data "$@"  # STAGE_DATA: the data copied to each node's local disk, read there
}

# The ranks checkpoint and exit (status 75) when this file appears; it lives in the project
# directory, which every node and the container see. Once their checkpoint is saved, rank 0 writes
# $DDP_STOP_FILE.saved beside it. A requeued job keeps its id: start clean.
export DDP_STOP_FILE="$PROJECT_DIR/.ddp-stop-${SLURM_JOB_ID:-local}"
rm -f "$DDP_STOP_FILE" "$DDP_STOP_FILE.saved"

# The line a failed run ends with (a refusal, a failed write, a lost rank: the ranks' one `error:` line) is
# also left in this file, where torchrun copies its root cause's reason (TORCHELASTIC_ERROR_FILE); srun's
# tasks write it themselves. run_requeueable prints it last, after torchrun's or srun's own failure report.
export TORCHELASTIC_ERROR_FILE="$PROJECT_DIR/.ddp-error-${SLURM_JOB_ID:-local}.json"
rm -f "$TORCHELASTIC_ERROR_FILE"

# The reason in an error file as torch.distributed.elastic writes it ({"message": {"message": ...}}).
error_reason() {
    [[ -s "$1" ]] || return 0
    local line="" python
    for python in python3 python; do
        line=$("$python" -c 'import json, sys
m = json.load(open(sys.argv[1]))["message"]
print((m["message"] if isinstance(m, dict) else m).splitlines()[-1])' "$1" 2>/dev/null) && break
    done
    # no Python on the host (CONTAINER): the message's text, its JSON escapes left as they are
    [[ -n "$line" ]] || line=$(sed -n 's/^{"message": {"message": "\(.*\)", "extraInfo".*/\1/p' "$1")
    echo "$line"
}

# torchrun dies of a SIGUSR1 unless told to forward it to the ranks as it forwards TERM and INT (torch >= 2.9
# reads this; older ones ignore it). It matters where Slurm signals every process of a step: --signal=USR1@N
# without B:.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

# Run "$@" in the background so that this shell can take Slurm's signals; on either, ask the ranks to
# checkpoint and stop (the stop file: the ranks on every node and in a container see it), then:
#   USR1, the time-limit warning the scripts ask for (--signal=B:USR1@180): requeue the job, which resumes.
#   TERM, sent to every process of the job by scancel, by the time limit itself and by a preemption (then
#        KILL after KillWait, or GraceTime for a preemption): end the job. A cancel is the user's word; a
#        preemption with PreemptMode=REQUEUE is requeued by Slurm itself. Submitting the same command again
#        resumes.
# A TERM after a USR1 (the time limit reached before the stop) ends the job too.
STOP_SIGNAL=""
run_requeueable() {
    trap 'STOP_SIGNAL=${STOP_SIGNAL:-USR1}; touch "$DDP_STOP_FILE"
          echo "=== $(date -Is): signal received: asking the ranks to checkpoint and stop" \
               "(USR1, the time-limit warning: the job then requeues itself)"' USR1
    trap 'STOP_SIGNAL=TERM; touch "$DDP_STOP_FILE"
          echo "=== $(date -Is): signal received: asking the ranks to checkpoint and stop" \
               "(TERM: scancel, the time limit or a preemption: the job then ends)"' TERM
    "$@" &
    local pid=$! status=0
    # `wait` returns early whenever a trapped signal arrives: keep waiting until the run has ended.
    while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
    wait "$pid" || status=$?
    trap - USR1 TERM
    end_staging  # STAGE_DATA: each node's copy removed, said before the run's last line
    # The ranks' own word that they stopped on request with a checkpoint (StopRequest.say_stopped).
    local saved="" reason=""
    [[ -e "$DDP_STOP_FILE.saved" ]] && saved=yes
    [[ $status -ne 0 ]] && reason=$(error_reason "$TORCHELASTIC_ERROR_FILE")
    rm -f "$DDP_STOP_FILE" "$DDP_STOP_FILE.saved" "$TORCHELASTIC_ERROR_FILE"
    if [[ $status -ne 0 && ( -n "$STOP_SIGNAL" || -n "$saved" ) ]]; then
        if [[ -n "$saved" ]]; then
            echo "=== $(date -Is): the run stopped on request, checkpointed (the ranks exit 75;" \
                 "the launcher reports $status, so its FAILED lines in the .err file are expected)"
        else
            echo "=== $(date -Is): the run ended with status $status before it could checkpoint (signalled" \
                 "while starting, before training): the last checkpoint, if any, is intact"
        fi
        if [[ "$STOP_SIGNAL" == USR1 ]]; then
            echo "=== requeueing job $SLURM_JOB_ID to resume"
            scontrol requeue "$SLURM_JOB_ID" && exit 0
            echo "=== requeue failed (is JobRequeue allowed here?); resubmit this job to resume" >&2
            exit "$status"
        fi
        # TERM to the shell, or a signal that reached the ranks alone (a preemption's grace time signals the
        # tasks).
        echo "=== job ${SLURM_JOB_ID:-} ends here (cancelled, timed out or preempted; Slurm requeues a" \
             "preempted job itself where PreemptMode=REQUEUE): to resume, submit the same command again"
        exit "$status"
    fi
    if [[ -n "$reason" ]]; then  # the ranks' own line, last in both logs: what a `tail` of either shows
        echo "=== $(date -Is): finished with status $status: $reason"
        echo "=== $(date -Is): finished with status $status: $reason" >&2
    else
        echo "=== $(date -Is): finished with status $status"
    fi
    exit "$status"
}
