"""A mistyped flag of train_ddp.py: one `error:` line (no usage block), naming the flags it may have meant,
and exit status 2; an abbreviation is a typo too, never a guess (--epoch is not taken for --epochs)."""
import pytest

from train_utils import RECIPES, get_args_parser
from machinery.cli import parse_flags


def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_flags(get_args_parser(), RECIPES, [str(a) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "usage:" not in err, err
    return err.strip()


@pytest.mark.parametrize("argv, hint", [
    (["--batchsize", 64], "did you mean --batch-size?"),
    (["--batch_size", 64], "did you mean --batch-size?"),
    (["--lr", 0.1], "did you mean --base-lr, --lr-scaling or --lr-schedule?"),
    (["--epoch", 3], "did you mean --epochs or --stop-after-epoch?"),
])
def test_a_mistyped_flag_is_one_line_naming_the_flags_it_may_have_meant(capsys, argv, hint):
    line = refused(capsys, *argv)
    assert line == f"error: unknown flag {argv[0]}; {hint} (see --help)"


def test_two_mistyped_flags_are_named_each_with_its_guess(capsys):
    line = refused(capsys, "--batchsize", 64, "--epoch=3")
    assert line == ("error: unknown flags --batchsize, --epoch; --batchsize: did you mean --batch-size?; --epoch: "
                    "did you mean --epochs or --stop-after-epoch? (see --help)")


def test_a_flag_like_no_other_is_one_line_without_a_guess_and_a_bad_value_names_its_flag(capsys):
    assert refused(capsys, "--zzz", 1) == "error: unknown flag --zzz (see --help)"
    assert refused(capsys, "stray") == "error: unrecognized arguments: stray (see --help)"
    assert refused(capsys, "--epochs", "x") == "error: argument --epochs: invalid int value: 'x' (see --help)"


def test_an_abbreviation_is_not_taken_for_the_flag_it_begins(capsys):
    assert "unknown flag --epoch; did you mean --epochs" in refused(capsys, "--epoch", 3)
    assert "--dropout" in refused(capsys, "--drop", 0.1)
    args, given = parse_flags(get_args_parser(), RECIPES, ["--epochs", "3"])
    assert args.epochs == 3 and given == {"epochs"}
