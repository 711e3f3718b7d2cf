"""The recipe the job scripts run (RECIPE in jobs/lib.sh): the WRN paper's, carried to its batch; the
arguments after a job script override it; train_ddp.py's own defaults stay the original script's smoke run."""
from support import ROOT, job_recipe
from train_ddp import get_args_parser


def test_the_job_recipe_is_the_wrn_papers_carried_to_its_batch_and_arguments_override_it():
    parser = get_args_parser()
    recipe = parser.parse_args(job_recipe())
    # WRN-16-8, 200 epochs, SGD with Nesterov momentum 0.9, weight decay 5e-4, LR 0.1 per 128 samples,
    # x0.2 at 30/60/80% of training (epochs 60, 120, 160), warm-up for the larger batch.
    assert (recipe.depth, recipe.widen_factor, recipe.epochs) == (16, 8, 200)
    assert recipe.nesterov and recipe.momentum == 0.9 and recipe.weight_decay == 5e-4
    assert (recipe.base_lr, recipe.reference_batch_size, recipe.lr_scaling) == (0.1, 128, "linear")
    assert recipe.lr_schedule == "step" and recipe.warmup_epochs >= 1
    # The job scripts put the user's arguments after the recipe: the last one wins.
    override = parser.parse_args([*job_recipe(), "--epochs", "30", "--no-nesterov"])
    assert override.epochs == 30 and not override.nesterov and override.depth == 16
    # train_ddp.py's own defaults stay the original script's smoke run, and --help says where the recipe is.
    defaults = parser.parse_args([])
    assert (defaults.epochs, defaults.batch_size, defaults.base_lr) == (5, 512, 0.01)
    assert "jobs/lib.sh" in parser.format_help()
    for script in ("multigpu.sh", "multinode.sh", "srun_direct.sh"):
        text = open(f"{ROOT}/jobs/{script}").read()
        assert 'train_ddp.py "${RECIPE[@]}" "$@"' in text and 'print_recipe "$@"' in text, script
