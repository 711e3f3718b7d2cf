"""The command line: flags parsed once, --recipe's preset under explicit flags, needless tracebacks made one line."""
from __future__ import annotations

import argparse
import atexit
import faulthandler
import gc
import signal
import sys
import textwrap

from torch.distributed.elastic.multiprocessing.errors import record

from machinery.launch import read_dist_env
from machinery.output import report_to_launcher


def run_cli(main, parser, recipes: dict, argv=None) -> int:
    """Run main(args, explicit) (`explicit`: the dests given) with --recipe applied; Ctrl-C before the training loop
    (later, it is a checkpointed stop) and a hung or dead peer are one line on every rank, not a wall of C++ frames."""
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 <pid>`: where is it stuck?
    free_traceback_at_exit()  # a bug's traceback: its frames, the DDP model among them, freed before finalization
    args, explicit = parse_flags(parser, recipes, sys.argv[1:] if argv is None else argv)
    try:
        return record(main)(args, explicit)  # a bug's traceback goes into torchrun's failure report
    except KeyboardInterrupt:
        line = f"rank {read_dist_env().rank}: interrupted outside the training loop; nothing to save"
        print(line, file=sys.stderr, flush=True)
        report_to_launcher(line)
        return 130
    except RuntimeError as e:
        from machinery.diagnose import describe_comm_failure
        if (why := describe_comm_failure(e, args.timeout)) is None:
            raise
        line = f"error: rank {read_dist_env().rank}: {why}"
        print(line, file=sys.stderr, flush=True)
        report_to_launcher(line)
        return 1


def free_traceback_at_exit() -> None:
    """At exit, while the interpreter is still whole, free the frames of the traceback Python printed (a bug's): they
    hold the DDP model and through it the process group's threads, which freed during the interpreter's finalization
    can abort the process after the traceback ("terminate called without an active exception"). A debugger's
    post-mortem (python -m pdb) has had them by then. Registered once, however often called."""
    atexit.unregister(_free_printed_traceback)
    atexit.register(_free_printed_traceback)


def _free_printed_traceback() -> None:
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:  # exc: 3.12+
        sys.last_exc = sys.last_type = sys.last_value = sys.last_traceback = None
        gc.collect()


def parse_flags(parser, recipes: dict, argv) -> tuple:
    """(flags, dests given), --recipe NAME's preset (recipes[NAME]: dest -> value) under the given flags, any order."""
    class Formatter(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        """The parser's own, with the epilog's lines kept: one preset per paragraph."""
    parser.formatter_class = Formatter
    presets = [textwrap.fill(f"--recipe {name}: {describe_preset(preset)}", 100, subsequent_indent="    ",
                             break_on_hyphens=False, break_long_words=False)
               for name, preset in recipes.items()]
    parser.epilog = "\n".join([textwrap.fill(parser.epilog or "", 100), "", "Presets (flags given win):",
                               *presets])
    parser.error = lambda message: refuse_flags(parser, message)  # argparse's error: see below
    args, given = parse_once(parser, argv)
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


def parse_once(parser, argv) -> tuple:
    """(flags, dests given) from one parse: each dest starts as a marker, left alone unless given, then defaulted.
    The dests and their defaults are what the parser makes of no flags at all."""
    unset, defaults = object(), vars(parser.parse_args([]))
    args = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(defaults, unset)))
    given = {dest for dest in defaults if getattr(args, dest) is not unset}
    for dest in defaults.keys() - given:
        setattr(args, dest, defaults[dest])
    return args, given


def refuse_flags(parser, message: str):
    """argparse's error, in this script's form (machinery/diagnose.py): one line, exit status 2."""
    from machinery.diagnose import refuse_flags as refuse
    refuse(parser, message)
