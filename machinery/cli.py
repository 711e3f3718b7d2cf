"""The command line: flags parsed once, a named preset (--recipe) under the explicit flags, the flags
checked, and the tracebacks a user should not have to read turned into one line."""
from __future__ import annotations

import argparse
import copy
import difflib
import faulthandler
import re
import signal
import sys
import textwrap

import torch

from machinery.errors import UserError, describe_comm_failure
from machinery.launch import read_dist_env
from machinery.output import is_main_process, log


def run_cli(main, parser, recipes: dict, argv=None) -> int:
    """Parse the command line, apply --recipe's preset, and run main(args, explicit) (`explicit`: the
    flags given on the command line), minus the tracebacks a user should not have to
    read: Ctrl-C before the training loop (which turns later ones into a checkpointed stop), and a hung
    or dead peer, said in one line on every rank instead of a wall of C++ frames."""
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 <pid>`: where is it stuck?
    args, explicit = parse_flags(parser, recipes, sys.argv[1:] if argv is None else argv)
    try:
        return main(args, explicit)
    except KeyboardInterrupt:
        print(f"rank {read_dist_env().rank}: interrupted outside the training loop; nothing to save", file=sys.stderr,
              flush=True)
        return 130
    except RuntimeError as e:
        if (why := describe_comm_failure(e, args.timeout)) is None:
            raise
        print(f"error: rank {read_dist_env().rank}: {why}", file=sys.stderr, flush=True)
        return 1


def run_tool(main, parser) -> int:
    """The tools' entry point (bench.py, preflight.py): SIGTERM and Ctrl-C end them at once in one line
    (catch_stop_signals), and a UserError is one `error:` line from rank 0 and exit status 2. Returns
    main(args)'s status (None: 0)."""
    from machinery.signals import catch_stop_signals
    catch_stop_signals()
    try:
        return main(parser.parse_args()) or 0
    except UserError as e:
        log(f"error: {e}", file=sys.stderr)
        return 2


def parse_flags(parser, recipes: dict, argv) -> tuple:
    """The flags, with --recipe NAME's preset (recipes[NAME]: flag dest -> value) under those given on
    the command line, whatever their order; and the set of dests given on the command line. --help
    lists the presets and what each sets."""
    class Formatter(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        """The parser's own, with the epilog's lines kept: one preset per paragraph."""
    parser.formatter_class = Formatter
    presets = [textwrap.fill(f"--recipe {name}: {describe_preset(preset)}", 100, subsequent_indent="    ",
                             break_on_hyphens=False, break_long_words=False) for name, preset in recipes.items()]
    parser.epilog = "\n".join([textwrap.fill(parser.epilog or "", 100), "", "Presets (flags given win):", *presets])
    parser.error = lambda message: refuse_flags(parser, message)
    args = parser.parse_args(argv)
    given = explicit_flags(parser, argv)
    preset = recipes.get(args.recipe, {}) if getattr(args, "recipe", None) else {}
    unknown = [k for k in preset if not hasattr(args, k)]
    assert not unknown, f"recipe {args.recipe} sets no such flags: {unknown}"
    for dest, value in preset.items():
        if dest not in given:
            setattr(args, dest, value)
    return args, given  # the preset's values stay defaults of a kind: --evaluate takes the checkpoint's


def describe_preset(preset: dict) -> str:
    """A preset as the flags it sets: `--epochs 200 --nesterov ...`."""
    def flag(dest, value):
        name = "--" + dest.replace("_", "-")
        if value is True or value is False:
            return name if value else "--no-" + name[2:]
        return f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
    return " ".join(flag(d, v) for d, v in preset.items())


def check_args(args, world_size: int, device: torch.device) -> None:
    """Reject bad input before any work, with one line that says what to change."""
    if args.batch_size < 1 or (args.batch_size % world_size and not args.evaluate):
        raise UserError(f"--batch-size {args.batch_size} must be a positive multiple of the world size "
                        f"{world_size}; try --batch-size {max(1, round(args.batch_size / world_size)) * world_size}")
    if args.epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {args.epochs}")
    if not 0.0 <= args.target_accuracy <= 1.0:
        raise UserError(f"--target-accuracy is a fraction in [0, 1], got {args.target_accuracy} (85% is 0.85)")
    for name in ("patience", "reference_batch_size", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("train_size", "test_size", "warmup_epochs", "weight_decay", "stop_after_epoch", "checkpoint_every",
                 "skip_bad_samples"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard "
                            "(or pip install -e '.[tensorboard]')") from None
    if args.micro_batch is not None and args.micro_batch < 1:
        raise UserError(f"--micro-batch is the most samples per forward on one rank, at least 1, got {args.micro_batch} "
                        f"(leave it out for no cap)")
    if args.sync_bn and device.type != "cuda":
        raise UserError("--sync-bn needs CUDA GPUs (torch implements SyncBatchNorm only there); leave it out on CPU")
    check_recipe_args(args)
    if not (0.0 <= args.dropout < 1.0 and 0.0 <= args.label_smoothing < 1.0 and args.base_lr > 0):
        raise UserError("--dropout and --label-smoothing must lie in [0, 1), and --base-lr must be positive")


def check_recipe_args(args) -> None:
    """The modern recipe's flags."""
    if not 0.0 < args.model_ema_decay < 1.0:
        raise UserError(f"--model-ema-decay is the average's decay per reference batch, in (0, 1), got "
                        f"{args.model_ema_decay} (0.999: the last ~1,000 reference batches weigh most)")
    if args.clip_grad_norm is not None and args.clip_grad_norm <= 0:
        raise UserError(f"--clip-grad-norm must be positive, got {args.clip_grad_norm} (leave it out for no clipping)")
    if args.norm_weight_decay is not None and args.norm_weight_decay < 0:
        raise UserError(f"--norm-weight-decay must not be negative, got {args.norm_weight_decay} (leave it out: "
                        f"--weight-decay for all)")
    if not 0.0 <= args.random_erase <= 1.0:
        raise UserError(f"--random-erase is a probability in [0, 1], got {args.random_erase}")
    for name in ("mixup_alpha", "cutmix_alpha", "val_size"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)} (0: off)")


def refuse_flags(parser, message: str):
    """argparse's error, in this script's form: one `error:` line from rank 0 (every rank parses the
    same command line and leaves with it), naming the flags a mistyped one may have meant; exit status 2."""
    if is_main_process():
        print(f"error: {message}{suggest_flags(parser, message)} (see --help)", file=sys.stderr, flush=True)
    sys.exit(2)


def suggest_flags(parser, message: str) -> str:
    """`; did you mean --batch-size?` for the unknown flags in argparse's message: the flags spelled alike
    (--batchsize, --epoch), or holding the word (--lr: --base-lr, --lr-scaling, --lr-schedule)."""
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    unknown = re.findall(r"(?<![\w-])(--[\w-]+)", message.split("unrecognized arguments:", 1)[-1]) \
        if "unrecognized arguments:" in message else []
    hints = []
    for flag in dict.fromkeys(f for f in unknown if f not in known):
        word = flag[2:].replace("_", "-")
        alike = difflib.get_close_matches("--" + word, known, n=3, cutoff=0.75)
        holding = [o for o in known if word in o[2:].split("-") and o not in alike][:3 - len(alike)]
        if alike or holding:
            names = alike + holding
            said = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            hints.append(f"{flag}: did you mean {said}?")
    return "; " + "; ".join(hints) if hints else ""


def explicit_flags(parser, argv) -> set:
    """The flags given on the command line, as argparse dests (the rest are defaults)."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(argv)))
