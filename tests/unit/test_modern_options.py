"""The modern recipe's pieces in-process (torchvision's ops as build_transforms gives them, dataset_utils.Mix,
dataset_utils.hold_out, the EMA's decay, --init-from's reading): TrivialAugmentWide and random erasing drawn per
image from its key, the same on both loaders; mixup/cutmix the same for W ranks x A micro-steps as for W x A
ranks; the held-out split
disjoint and fixed. The entry point's behaviours (resume, ranks x micro-steps, best.pt, ...) are in
tests/e2e/test_modern_recipe.py."""
import argparse

import pytest
import torch

import dataset_utils as du
import support
import train_ddp
from machinery.errors import UserError
from machinery.init_weights import load_initial_weights
from machinery.launch import DistEnv
from model import WideResNet

AUGMENT = dict(auto_augment="ta_wide", random_erase=0.5, mixup_alpha=0.0, cutmix_alpha=0.0)


def random_images(n, channels=3, size=(20, 24), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, channels, *size), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("channels", [1, 3])
def test_trivial_augment_and_random_erasing_are_torchvision_s_drawn_per_image_from_its_key(channels):
    """--auto-augment ta_wide and --random-erase are torchvision's TrivialAugmentWide and RandomErasing (filled
    with the data's mean colour), each image's draws seeded from (seed, epoch, index): the same image whatever
    else the loader reads before it, most images changed, and the training's own generator left as it was."""
    from torchvision.transforms import v2
    data = du.ImageData(random_images(64, channels), torch.arange(64) % 10)
    spec = du.measure_data(data, data)
    train, _, _ = train_ddp.build_transforms(argparse.Namespace(**AUGMENT), spec)
    kinds = [type(t) for t in train.transforms]
    assert kinds[2:] == [v2.TrivialAugmentWide, v2.RandomErasing]
    assert train.transforms[3].value == [round(255 * m) for m in spec.mean]
    dataset = du.ImageDataset(data, transform=train, seed=3)
    state = torch.get_rng_state()
    forward = [dataset[(2, i)][0] for i in range(64)]
    backward = [dataset[(2, i)][0] for i in reversed(range(64))][::-1]
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))
    assert sum(not torch.equal(a, dataset[(3, i)][0]) for i, a in enumerate(forward)) > 48  # another epoch
    plain = du.ImageDataset(data, transform=train_ddp.build_transforms(
        argparse.Namespace(**{**AUGMENT, "auto_augment": None, "random_erase": 0.0}), spec)[0], seed=3)
    assert sum(not torch.equal(a, plain[(2, i)][0]) for i, a in enumerate(forward)) > 32  # TA and erasing act


def test_both_loaders_give_the_same_augmented_batches():
    data = du.ImageData(random_images(40), torch.arange(40) % 10)
    spec = du.measure_data(data, data)
    common = dict(batch_size=8, rank=1, world_size=2, accum_steps=1, eval_batch=8, seed=5, workers=0,
                  pin_memory=False, augment={**AUGMENT, "mixup_alpha": 0.2, "cutmix_alpha": 1.0}, spec=spec)
    (torch_train, _), (dev_train, _) = (
        support.build_loaders(data, data, **common),
        support.build_loaders(data, data, **common, device=torch.device("cpu")))
    for loader in (torch_train, dev_train):
        loader.batch_sampler.set_epoch(3)
        loader.batch_sampler.start_at(8)
    batches = list(zip(torch_train, dev_train))
    assert len(batches) == 4
    for (a, la), (b, lb) in batches:
        assert torch.equal(a, b) and torch.equal(la, lb)
        assert la.shape == (4, 10) and torch.allclose(la.sum(1), torch.ones(4))


def mixed_steps(world_size, accum, position=64):
    """Rank r's micro-batches of one global step of 8, mixed, for W ranks x A micro-steps: keyed by virtual
    rank."""
    images = random_images(8, 3, (8, 8))
    labels = torch.arange(8)
    out = {}
    for rank in range(world_size):
        micro = du.deal_step(8, rank, world_size, accum)
        flags = argparse.Namespace(**{**AUGMENT, "mixup_alpha": 0.4, "cutmix_alpha": 1.0})
        spec = du.DataSpec(3, 8, 8, num_classes=8, mean=(0.5,) * 3, std=(0.25,) * 3)
        mix = du.Mix(train_ddp.build_transforms(flags, spec)[2], num_classes=8, seed=2, rank=rank,
                             world_size=world_size)
        idx = torch.tensor([i for m in micro for i in m])
        x, t = mix(images[idx], labels[idx], epoch=4, position=position, micro_sizes=[len(m) for m in micro])
        start = 0
        for k, m in enumerate(micro):
            out[rank + k * world_size] = (x[start:start + len(m)], t[start:start + len(m)])
            start += len(m)
    return out


def test_mixup_and_cutmix_mix_each_virtual_rank_alike_for_any_ranks_x_micro_steps():
    reference = mixed_steps(4, 1)
    for world_size, accum in ((2, 2), (1, 4)):
        got = mixed_steps(world_size, accum)
        assert sorted(got) == sorted(reference)
        for v in reference:
            assert torch.equal(got[v][0], reference[v][0]) and torch.equal(got[v][1], reference[v][1])
    assert any(not torch.equal(a[0], b[0])
               for a, b in zip(reference.values(), mixed_steps(4, 1, 72).values()))
    for _, targets in reference.values():  # soft targets: two classes, summing to 1
        assert torch.allclose(targets.sum(1), torch.ones(len(targets)))
        assert ((targets > 0).sum(1) <= 2).all()


def test_the_validation_split_is_held_out_the_same_whatever_the_seed_and_never_trained():
    data = du.ImageData(random_images(50, 1, (4, 4)), torch.arange(50))
    train, val = du.hold_out(data, 12)
    again, val_again = du.hold_out(data, 12)
    assert len(val) == 12 and len(train) == 38
    assert torch.equal(val.labels, val_again.labels) and torch.equal(train.labels, again.labels)
    assert not set(train.labels.tolist()) & set(val.labels.tolist())
    assert sorted(train.labels.tolist() + val.labels.tolist()) == list(range(50))
    with pytest.raises(UserError, match="--val-size 50 leaves no training samples"):
        du.hold_out(data, 50)


def test_ema_decay_is_per_reference_batch_so_its_horizon_in_samples_keeps_with_the_batch():
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    import train_utils as config
    for batch, expect in ((128, 0.99), (512, 0.99 ** 4), (64, 0.99 ** 0.5)):
        args = config.get_args_parser().parse_args(
            ["--batch-size", str(batch), "--reference-batch-size", "128", "--model-ema-decay", "0.99"])
        assert config.make_config(args, env).ema_decay == pytest.approx(expect)


def small_wrn(classes, channels=3, width=1):
    torch.manual_seed(1)
    return WideResNet(10, width, num_classes=classes, in_channels=channels)


def test_init_from_keeps_every_layer_and_starts_another_head_afresh(tmp_path):
    source = small_wrn(10)
    # DDP-prefixed
    torch.save({"module." + k: v for k, v in source.state_dict().items()}, tmp_path / "ddp.pt")
    model = small_wrn(100)
    torch.manual_seed(9)
    model.fc.reset_parameters()
    fresh_head = model.fc.weight.detach().clone()
    line = load_initial_weights(model, str(tmp_path / "ddp.pt"))
    assert "classifier head fc (10 classes) is re-initialised for this model's 100 classes" in line
    for key, tensor in model.state_dict().items():
        if key.startswith("fc."):
            continue
        assert torch.equal(tensor, source.state_dict()[key]), key
    assert torch.equal(model.fc.weight, fresh_head)


def test_init_from_refuses_another_layer_naming_it(tmp_path):
    torch.save(small_wrn(10, channels=1).state_dict(), tmp_path / "gray.pt")
    with pytest.raises(UserError,
                       match=r"--init-from .*gray.pt: layer \S+ is \(16, 1, 3, 3\), the model's "
                             r"\(16, 3, 3, 3\)"):
        load_initial_weights(small_wrn(10), str(tmp_path / "gray.pt"))
    torch.save(small_wrn(10, width=2).state_dict(), tmp_path / "wide.pt")
    with pytest.raises(UserError, match=r"--init-from .*wide.pt: its tensor \S+ has no place in this model"):
        load_initial_weights(small_wrn(10), str(tmp_path / "wide.pt"))
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(UserError, match="does not load as a checkpoint or a state_dict"):
        load_initial_weights(small_wrn(10), str(tmp_path / "junk.pt"))
    with pytest.raises(UserError, match="no such file"):
        load_initial_weights(small_wrn(10), str(tmp_path / "absent.pt"))


def test_recipe_flags_are_checked_in_one_line():
    from train_utils import check_args, get_args_parser
    good = get_args_parser().parse_args([])
    check_args(good, 1, torch.device("cpu"))
    for change, says in ((dict(model_ema_decay=1.0), "--model-ema-decay is the average's decay"),
                         (dict(clip_grad_norm=0.0), "--clip-grad-norm must be positive"),
                         (dict(random_erase=1.5), "--random-erase is a probability"),
                         (dict(mixup_alpha=-1.0), "--mixup-alpha must not be negative"),
                         (dict(val_size=-2), "--val-size must not be negative"),
                         (dict(norm_weight_decay=-1.0), "--norm-weight-decay must not be negative")):
        with pytest.raises(UserError, match=says):
            check_args(argparse.Namespace(**{**vars(good), **change}), 1, torch.device("cpu"))


def test_best_pt_is_written_only_at_an_epoch_better_than_every_one_before():
    from machinery.checkpoints import is_best_epoch
    accs = [0.2, 0.5, 0.4, 0.5, 0.7, 0.6]
    history = [{"val_acc": a} for a in accs]
    assert ([is_best_epoch(history[:k + 1]) for k in range(len(accs))]
            == [True, True, False, False, True, False])


def test_every_flag_has_a_resume_rule_and_every_rule_a_flag():
    import train_utils as config
    from machinery import checkpoints
    rules = config.RESUME_RULES
    assert set(rules) == set(vars(config.get_args_parser().parse_args([])))
    kinds = {checkpoints.DATA, checkpoints.MODEL, checkpoints.RECIPE, checkpoints.NOTED, checkpoints.QUIET}
    assert all((rule[0] if isinstance(rule, tuple) else rule) in kinds for rule in rules.values())


@pytest.mark.parametrize("change, says", [
    (["--mixup-alpha", "0.2"], "--mixup-alpha 0.2 differs from the None of the checkpoint"),
    (["--model-ema"], "leave --model-ema out to continue it"),
    (["--val-size", "100"],
     "--val-size 100 differs from the 0 of the checkpoint .* or --val-size 0 to continue it"),
])
def test_a_checkpoint_from_before_the_options_is_not_continued_with_one_turned_on(change, says):
    import train_utils as config
    from machinery.resume import checkpoint_flags
    before = vars(config.get_args_parser().parse_args([]))
    recipe_flags = [k for k, rule in config.RESUME_RULES.items() if config.RECIPE in (rule, rule[0])]
    assert "mixup_alpha" in recipe_flags and "model_ema" in recipe_flags
    saved = {k: v for k, v in before.items() if k not in recipe_flags + ["val_size", "tta", "init_from"]}
    ckpt = {"config": {**saved, "micro_batch_size": 512}, "model_config": {"depth": 16, "widen_factor": 8}}
    # may change
    flags, notes = checkpoint_flags(config.get_args_parser().parse_args(["--tta"]), {"tta"}, ckpt,
                                    config.RESUME_RULES)
    assert flags["tta"] and notes == []
    with pytest.raises(UserError, match=says):
        checkpoint_flags(config.get_args_parser().parse_args(change), set(), ckpt, config.RESUME_RULES)
