"""The recipe the job scripts run (RECIPE in jobs/lib.sh), and the LR rule that carries a tuned run
to a larger global batch."""
import re
import tempfile

from conftest import ROOT, TINY, job_recipe, launch, read_jsonl, write_cifar100
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
    # train_ddp.py's own defaults stay the seed's smoke run, and --help says where the recipe is.
    defaults = parser.parse_args([])
    assert (defaults.epochs, defaults.batch_size, defaults.base_lr) == (5, 512, 0.01)
    assert "jobs/lib.sh" in parser.format_help()
    for script in ("multigpu.sh", "multinode.sh", "srun_direct.sh"):
        text = open(f"{ROOT}/jobs/{script}").read()
        assert 'train_ddp.py "${RECIPE[@]}" "$@"' in text and 'print_recipe "$@"' in text, script


def test_the_lr_rule_carries_a_tuned_run_to_a_4x_larger_batch():
    """A tiny WRN tuned at batch 16 (LR 0.05). At batch 64 (1 rank, 4 accumulation steps of 16, so the
    same memory), the linear rule (LR 0.2) with warm-up ends within a few points of it, while the
    unscaled LR ends far behind: 4x fewer steps at the same LR do not get as far. Data hard enough
    (noise 40) that the small-batch run does not saturate. Measured over seeds 0 and 1: 89.8/90.2% at
    batch 16; 84.2/86.0% linear, 61.2/57.4% unscaled at batch 64."""
    with tempfile.TemporaryDirectory() as d:
        write_cifar100(d, 2000, 500, archive=False, noise=40.0)
        common = ["--data-dir", d, "--epochs", 6, "--base-lr", 0.05, "--reference-batch-size", 16, "--warmup-epochs", 1,
                  "--target-accuracy", 1.0, "--log-every", 0, *TINY, "--device", "cpu"]
        acc = {}
        for name, flags in {"small": ["--batch-size", 16],
                            "linear": ["--batch-size", 64, "--micro-batch", 16],
                            "none": ["--batch-size", 64, "--micro-batch", 16, "--lr-scaling", "none"]}.items():
            proc = launch([*common, *flags, "--out-dir", f"{d}/{name}"], torchrun=False)
            acc[name] = read_jsonl(f"{d}/{name}/metrics.jsonl")[-1]["val_acc"]
            if name != "small":
                assert "Global batch 64 = 1 ranks x 4 accumulation steps x 16;" in proc.stdout
                lr = {"linear": 0.2, "none": 0.05}[name]
                assert re.search(rf"LR {lr:g} \({'linear' if name == 'linear' else 'none'} scaling", proc.stdout)
    print(acc)
    assert 0.5 < acc["small"] < 0.97, acc  # it learns (chance is 1%), and does not saturate
    assert acc["small"] - acc["linear"] < 0.08, acc  # within a few points
    assert acc["linear"] - acc["none"] > 0.15, acc  # clearly worse without scaling
