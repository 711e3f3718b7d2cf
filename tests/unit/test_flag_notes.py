"""What a flag quietly does that a user probably did not mean is said in one line at the start
(train_utils.flag_notes): a --batch-size that the LR rule turns into a far smaller or larger LR, a warm-up
that takes most of a short run, a finished run extended with a larger --epochs whose schedule sends the LR back
up, a --compile-mode without --compile."""
from types import SimpleNamespace

from train_utils import flag_notes

ORIGINAL_DEFAULTS = dict(batch_size=512, reference_batch_size=512, base_lr=0.01, lr=0.01, lr_scaling="linear",
                         warmup_epochs=1.0, epochs=5, lr_schedule="cosine", compile=False, compile_mode="default")


def notes(ckpt=None, **changed):
    return flag_notes(SimpleNamespace(**{**ORIGINAL_DEFAULTS, **changed}), ckpt)


def test_a_small_batch_that_the_lr_rule_scales_far_below_base_lr_is_said_with_the_way_to_keep_it():
    assert notes() == [] and notes(batch_size=256, lr=0.005) == []  # half: what the rule is for
    assert notes(batch_size=64, lr=0.00125) == [
        "--batch-size 64 is far below --reference-batch-size 512, so linear scaling trains at LR 0.00125, 8x "
        "below --base-lr 0.01; to train at --base-lr as given, add --lr-scaling none (or "
        "--reference-batch-size 64)"]
    assert notes(batch_size=64, lr=0.01, lr_scaling="none") == []
    assert notes(batch_size=2048, lr=0.04) == []  # a larger batch, a larger LR: the rule's point, up to 4x


def test_a_large_batch_that_the_lr_rule_scales_far_above_base_lr_is_said_with_the_ways_to_tame_it():
    assert notes(batch_size=8192, lr=0.16) == [
        "--batch-size 8192 is far above --reference-batch-size 512, so linear scaling trains at LR 0.16, 16x "
        "above --base-lr 0.01; if the loss diverges, lengthen the warm-up (--warmup-epochs 1 now) or use "
        "--lr-scaling sqrt"]
    assert notes(batch_size=8192, lr=0.04, lr_scaling="sqrt") == []  # 4x: sqrt's own measure


def test_a_warm_up_that_takes_half_a_run_or_more_is_said():
    assert notes(warmup_epochs=5.0, epochs=6) == [
        "5 of the 6 epochs warm up (--warmup-epochs 5): the LR peaks only at epoch 5; for a short run, lower "
        "--warmup-epochs"]
    assert notes(warmup_epochs=5.0, epochs=200) == [] and notes(warmup_epochs=0.0, epochs=1) == []


def test_a_compile_mode_without_compile_is_said():
    assert notes(compile_mode="reduce-overhead") == [
        "--compile-mode reduce-overhead does nothing without --compile: add --compile"]
    assert notes(compile=True, compile_mode="reduce-overhead") == [] and notes(compile=True) == []


def test_a_finished_cosine_run_extended_with_more_epochs_says_its_lr_goes_back_up():
    finished = {"config": {"epochs": 4}, "progress": {"epoch": 4}}
    line, = notes(finished, epochs=15, lr=0.05, base_lr=0.05)
    assert line.startswith("--epochs 4 -> 15 stretches the cosine schedule: after epoch 4 the LR goes back "
                           "up from 0 to ")
    assert line.endswith("; to fine-tune at a low LR instead, start a new run from these weights "
                         "(--init-from) with its own schedule")
    # no schedule to stretch
    assert notes(finished, epochs=15, lr=0.05, base_lr=0.05, lr_schedule="constant") == []
    # the same run
    assert notes({"config": {"epochs": 15}, "progress": {"epoch": 4}}, epochs=15, lr=0.05, base_lr=0.05) == []
    # a little: no jump
    assert notes({"config": {"epochs": 4}, "progress": {"epoch": 1}}, epochs=5, lr=0.05, base_lr=0.05) == []
