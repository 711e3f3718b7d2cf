"""The command line: flags, --recipe's preset under those given, needless tracebacks made one line."""
import argparse
import atexit
import difflib
import faulthandler
import gc
import re
import signal
import sys
import textwrap

from torch.distributed.elastic.multiprocessing.errors import record

from machinery.launch import read_dist_env
from machinery.output import is_main_process, report_to_launcher


def run_cli(main, parser, recipes: dict, argv=None) -> int:
    """main(args, explicit dests) with --recipe applied; Ctrl-C before the loop, or a hung or dead peer: one line."""
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 <pid>`: where is it stuck?
    args, explicit = parse_flags(parser, recipes, sys.argv[1:] if argv is None else argv)
    try:
        return record(main)(args, explicit)  # a bug's traceback: into torchrun's report
    except KeyboardInterrupt:
        line, status = f"rank {read_dist_env().rank}: interrupted outside the training loop; nothing to save", 130
    except RuntimeError as e:
        from machinery.diagnose import describe_comm_failure
        if (why := describe_comm_failure(e, args.timeout)) is None:
            raise
        line, status = f"error: rank {read_dist_env().rank}: {why}", 1
    print(line, file=sys.stderr, flush=True)
    report_to_launcher(line)
    return status


@atexit.register  # on import: once, however often run_cli runs
def free_traceback_at_exit() -> None:
    """Free a printed traceback's frames (a DDP model) while the interpreter is whole: freed later, it can abort."""
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:  # exc: 3.12+
        sys.last_exc = sys.last_type = sys.last_value = sys.last_traceback = None
        gc.collect()


def parse_flags(parser, recipes: dict, argv) -> tuple:
    """(flags, dests given), --recipe NAME's preset (recipes[NAME]: dest -> value) under the given flags, any order."""
    # keep the epilog's lines: a preset a paragraph
    parser.formatter_class = type("Formatter", (parser.formatter_class, argparse.RawDescriptionHelpFormatter), {})

    def flag(dest, value):  # as typed: --nesterov, --no-nesterov, --depth 16
        name = ("--no-" if value is False else "--") + dest.replace("_", "-")
        if isinstance(value, bool):
            return name
        return f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
    presets = [textwrap.fill(f"--recipe {name}: {' '.join(flag(d, v) for d, v in preset.items())}", 100,
                             subsequent_indent="    ", break_on_hyphens=False, break_long_words=False)
               for name, preset in recipes.items()]
    parser.epilog = "\n".join([textwrap.fill(parser.epilog or "", 100), "", "Presets (flags given win):", *presets])

    def refuse(message: str):
        """argparse's error as one `error:` line from rank 0, naming the flags a typo may have meant; status 2."""
        # the usage line's long flags (argparse keeps its list private), and --help (named -h there)
        known = re.findall(r"(?<![\w-])--\w[\w-]*", parser.format_usage()) + ["--help"] * parser.add_help
        extra = [a.split("=", 1)[0] for a in message.partition("unrecognized arguments:")[2].split()]
        unknown = list(dict.fromkeys(f for f in extra if f.startswith("--") and f not in known))
        if unknown:
            hints = ""
            for typo in unknown:  # the flags spelled alike (--batchsize), or holding its word (--lr)
                word = typo[2:].replace("_", "-")
                alike = difflib.get_close_matches("--" + word, known, n=3, cutoff=0.75)
                names = alike + [o for o in known if word in o[2:].split("-") and o not in alike][:3 - len(alike)]
                said = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}" if names else ""
                hints += f"; {typo + ': ' if len(unknown) > 1 else ''}did you mean {said}?" if said else ""
            message = f"unknown flag{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}{hints}"
        if is_main_process():
            print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)
    parser.error = refuse
    # each dest starts as a marker, left alone unless given; defaults: those of no flags
    unset, defaults = object(), vars(parser.parse_args([]))
    args = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(defaults, unset)))
    given = {dest for dest in defaults if getattr(args, dest) is not unset}
    preset = recipes.get(args.recipe, {}) if "recipe" in given else {}
    assert not (bad := preset.keys() - defaults.keys()), f"recipe {args.recipe} sets no such flags: {bad}"
    for dest in defaults.keys() - given:
        setattr(args, dest, preset.get(dest, defaults[dest]))
    return args, given  # the preset's values stay defaults of a kind: --evaluate takes the checkpoint's
