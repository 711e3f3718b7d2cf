"""`train_ddp.py --self-check`: the recipe as shipped passes every guarantee; an adaptation broken one way fails the
guarantee it breaks, in a line naming the cause. Each check is a minute or two of short runs: few, and small."""
import time

import pytest

from support import launch
from test_adapt import ADAPTED_ENV, adapted_script
from test_diagnostics import UNUSED_HEAD_MODEL

SELF_CHECK = ["--self-check", "--dataset", "synthetic", "--depth", "10", "--widen-factor", "1"]
GUARANTEES = ("resumed mid-epoch", "2 ranks x 1", "the training and test splits", "evaluation",
              "every parameter")

# A counter kept as a plain tensor attribute: not in the state_dict, so a resume starts it again from 0.
COUNTING_MODEL = '''
def build_model(cfg, data) -> nn.Module:
    class Counting(WideResNet):
        def forward(self, x):
            if self.training:
                self.steps = getattr(self, "steps", torch.zeros(())) + 1
            return super().forward(x) * (1 + 0.1 * getattr(self, "steps", torch.zeros(())))
    return Counting(cfg.depth, cfg.widen_factor, num_classes=data.num_classes, dropout=cfg.dropout,
                    in_channels=data.channels)
'''

# A shift drawn from Python's random, which the loaders do not seed (one of 1024 offsets: never equal 4 times).
PYTHON_RANDOM_AUGMENTATION = '''
class RandomShift:
    def __call__(self, image):
        import random
        return image.roll(random.randrange(image.shape[-1]), -1).roll(random.randrange(image.shape[-2]), -2)


def build_transforms(cfg, data) -> tuple:
    return RandomShift(), None, None
'''

# One more training sample on rank 1 than on rank 0.
RANK_SPLIT_DATA = '''
def load_data(cfg, env, train: bool = True):
    return (dataset_utils.load_split(cfg.dataset, cfg.data_dir, True, cfg.train_size + env.rank) if train else None,
            dataset_utils.load_split(cfg.dataset, cfg.data_dir, False, cfg.test_size))
'''


def run_self_check(args, script="train_ddp.py", env=None):
    start = time.perf_counter()
    proc = launch(args, torchrun=False, script=script, env=env, check=False, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line[:2] in ("✔ ", "✗ ", "– ")]
    print(proc.stdout, proc.stderr, f"({time.perf_counter() - start:.0f} s)", sep="\n")
    return proc, lines


def test_the_recipe_as_shipped_holds_every_guarantee():
    proc, lines = run_self_check(SELF_CHECK)
    assert proc.returncode == 0
    assert len(lines) == 5 and all(line.startswith("✔ ") for line in lines), proc.stdout
    assert [g for g, line in zip(GUARANTEES, lines) if line.startswith(f"✔ {g}")] == list(GUARANTEES)
    assert "Self-check: 5 of 5 hold, 0 failed" in proc.stdout


@pytest.mark.parametrize("broken, function, source, cause", [
    ("resumed mid-epoch", "build_model", COUNTING_MODEL, "state the checkpoint misses"),
    ("resumed mid-epoch", "build_transforms", PYTHON_RANDOM_AUGMENTATION, "a generator the loaders do not seed"),
    ("the training and test splits", "load_data", RANK_SPLIT_DATA,
     "the train split differs by rank: rank 1 loaded 65 samples"),
    ("every parameter", "build_model", UNUSED_HEAD_MODEL, "aux_head.weight, aux_head.bias"),
], ids=["state-the-checkpoint-misses", "unseeded-augmentation", "split-by-rank", "unused-parameter"])
def test_an_adaptation_broken_one_way_fails_that_guarantee_naming_its_cause(tmp_path, broken, function, source,
                                                                             cause):
    script = adapted_script(tmp_path / "code", **{function: source})
    proc, lines = run_self_check(SELF_CHECK, script=script, env=ADAPTED_ENV)
    assert proc.returncode == 1
    failed = [line for line in lines if line.startswith(f"✗ {broken}")]
    assert len(failed) == 1 and cause in failed[0], proc.stdout
    assert "Self-check: " in proc.stdout
