"""Presets in Python (--recipe NAME, RECIPES in train_utils.py): wrn-paper is the WRN paper's recipe, carried
to its batch, and the job scripts run it by name (and pass their CPUs per task on to srun); flags given on
the command line win whatever their order; --help lists each preset and what it sets; with no --recipe the
defaults stay the original script's smoke run."""
import subprocess

import pytest

from machinery.cli import parse_flags
from support import ROOT, job_recipe
from train_utils import RECIPES, get_args_parser


def parse(argv):
    return parse_flags(get_args_parser(), RECIPES, argv)


def run_lib_sh(commands: str, *args, env: dict) -> subprocess.CompletedProcess:
    """`commands` run by bash after jobs/lib.sh is sourced (its own output dropped), as in a job script given
    `args`; in `env` alone, with the project's venv on PATH and PROJECT_DIR set."""
    return subprocess.run(["bash", "-c", f"source {ROOT}/jobs/lib.sh >/dev/null && {commands}", "job", *args],
                          env={"PATH": f"{ROOT}/.venv/bin:/usr/bin:/bin", "PROJECT_DIR": ROOT, **env},
                          capture_output=True, text=True)


def test_wrn_paper_is_the_wrn_papers_recipe_carried_to_its_batch():
    recipe, given = parse(["--recipe", "wrn-paper"])
    # WRN-16-8, 200 epochs, SGD with Nesterov momentum 0.9, weight decay 5e-4, LR 0.1 per 128 samples,
    # x0.2 at 30/60/80% of training (epochs 60, 120, 160), warm-up for the larger batch.
    assert (recipe.depth, recipe.widen_factor, recipe.epochs, recipe.batch_size) == (16, 8, 200, 512)
    assert recipe.nesterov and recipe.momentum == 0.9 and recipe.weight_decay == 5e-4
    assert (recipe.base_lr, recipe.reference_batch_size, recipe.lr_scaling) == (0.1, 128, "linear")
    assert recipe.lr_schedule == "step" and recipe.warmup_epochs >= 1
    assert recipe.patience == 0  # the whole schedule: no early stopping
    assert given == {"recipe"}  # what the command line gave: --evaluate takes the rest from the checkpoint


@pytest.mark.parametrize("argv", [["--recipe", "wrn-paper", "--epochs", "30", "--no-nesterov"],
                                  ["--epochs", "30", "--no-nesterov", "--recipe", "wrn-paper"]])
def test_flags_given_win_over_the_preset_whatever_their_order(argv):
    args, _ = parse(argv)
    assert args.epochs == 30 and not args.nesterov and args.depth == 16 and args.recipe == "wrn-paper"


def test_without_a_recipe_the_defaults_stay_the_original_script_s_smoke_run_and_help_lists_the_presets():
    defaults, given = parse([])
    assert (defaults.epochs, defaults.batch_size, defaults.base_lr, defaults.recipe) == (5, 512, 0.01, None)
    assert given == set()
    parser = get_args_parser()
    parse_flags(parser, RECIPES, [])
    text = " ".join(parser.format_help().split())
    assert "--recipe wrn-paper: --depth 16 --widen-factor 8" in text and "--nesterov" in text
    assert "--recipe cpu-try: --dataset synthetic" in text


def test_the_job_scripts_run_the_wrn_paper_preset_by_name_with_the_user_s_flags_after_it():
    assert job_recipe() == ["--recipe", "wrn-paper"]
    for script in ("multigpu.sh", "multinode.sh", "srun_direct.sh"):
        text = open(f"{ROOT}/jobs/{script}").read()
        assert 'train_ddp.py "${RECIPE[@]}" "$@"' in text and 'job_preamble "$@"' in text, script
    # job_preamble (lib.sh) prints the recipe, and the user's flags as they win over it
    out = run_lib_sh('job_preamble "$@"', "--epochs", "3", env={"SLURM_GPUS_ON_NODE": "0"})
    assert "=== recipe: --recipe wrn-paper " in out.stdout, out.stderr
    assert "=== arguments after the script (these win): --epochs 3" in out.stdout.splitlines(), out.stderr


@pytest.mark.parametrize("flags,out", [(["--epochs", "3", "--out-dir", "{tmp}/a"], "{tmp}/a"),
                                       (["--out-dir={tmp}/b", "--epochs", "3"], "{tmp}/b")])
def test_the_job_scripts_point_nccl_s_flight_recorder_at_the_out_dir_on_gpu_nodes(tmp_path, flags, out):
    flags, out = [f.format(tmp=tmp_path) for f in flags], out.format(tmp=tmp_path)
    script = ('flight_recorder "$@"; '
              'echo "$TORCH_NCCL_DUMP_ON_TIMEOUT|$TORCH_FR_DUMP_TEMP_FILE|$TORCH_NCCL_DEBUG_INFO_TEMP_FILE"')
    got = run_lib_sh(script, *flags, env={"SLURM_GPUS_ON_NODE": "4"})
    assert got.stdout.splitlines()[-1] == f"1|{out}/nccl_trace/rank_|{out}/nccl_trace/rank_", got.stderr
    assert (tmp_path / out.rsplit("/", 1)[1] / "nccl_trace").is_dir()
    cpu = run_lib_sh(script, *flags, env={"SLURM_GPUS_ON_NODE": "0"})
    assert cpu.stdout.splitlines()[-1] == "||"  # no GPUs granted: NCCL is not used


def test_data_dir_sets_the_data_and_the_container_binds_the_data_and_an_out_dir_outside_the_project(tmp_path):
    data, out = tmp_path / "data", tmp_path / "scratch" / "run"
    data.mkdir()
    script = 'printf "%s\\n" "${RECIPE[@]}"; echo "LAUNCH ${LAUNCH[*]}"'

    def source(extra_env, *flags):
        got = run_lib_sh(script, *flags, env={"CONTAINER": "/images/pytorch.sif", **extra_env})
        return got.stdout.splitlines()
    lines = source({"DATA_DIR": str(data)}, "--epochs", "3", "--out-dir", str(out))
    # the user's --data-dir would follow
    assert lines[:4] == ["--recipe", "wrn-paper", "--data-dir", str(data)]
    assert lines[-1] == (f"LAUNCH apptainer exec --nv --bind {ROOT},{data},{out} --pwd {ROOT} "
                         f"/images/pytorch.sif")
    assert out.is_dir()  # a bind needs the folder
    lines = source({}, "--out-dir", "runs/x")  # no DATA_DIR: train_ddp.py's ./datasets; inside the project
    assert lines[:2] == ["--recipe", "wrn-paper"] and len(lines) == 3
    assert lines[-1] == f"LAUNCH apptainer exec --nv --bind {ROOT} --pwd {ROOT} /images/pytorch.sif"


@pytest.mark.parametrize("env,passed_on", [({"SLURM_CPUS_PER_TASK": "8"}, "8"), ({}, ""),
                                           ({"SLURM_CPUS_PER_TASK": "8", "SRUN_CPUS_PER_TASK": "4"}, "4")])
def test_every_job_passes_its_cpus_per_task_on_to_srun(env, passed_on):
    """Since Slurm 22.05 srun does not take --cpus-per-task from the job: jobs/lib.sh exports it as
    SRUN_CPUS_PER_TASK (one the user set wins; none without --cpus-per-task)."""
    got = run_lib_sh('printf "%s" "${SRUN_CPUS_PER_TASK:-}"', env=env)
    assert got.returncode == 0 and got.stdout == passed_on, got.stderr
