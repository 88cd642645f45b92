"""The `mambakit` command: thin subcommands that parse arguments and call the library.

A user's mistake (a bad flag value, a missing or malformed file, a device that is
not there, a run folder in use) is reported in one line on stderr naming the flag or
file, with exit status 2 and no traceback; `--debug` shows the traceback. Ctrl-C exits
with status 130; `train` exits with 1 when the run diverges.

Only the subcommand named is imported (`mambakit --help` imports no torch).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> the one-line help of the top-level listing; each lives in cli/<name>.py
SUBCOMMANDS = {
    "demo": "forward + step() on a freshly built model, with timings",
    "train": "train a Mamba LM (default: tiny preset on the Python standard library's source)",
    "generate": "stream a continuation of --prompt from a checkpoint",
    "task": "train on a synthetic task of the Mamba paper and test it from 2^6 to 2^20 steps",
    "serve": "serve a checkpoint over the OpenAI HTTP API (continuous batching, prefix cache)",
}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return text


def _parser(command: str | None) -> argparse.ArgumentParser:
    """The command line's parser, with the arguments of `command` alone (the others are
    listed by name and help line, their modules not imported)."""
    parser = argparse.ArgumentParser(prog="mambakit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, line in SUBCOMMANDS.items():
        if name != command:
            sub.add_parser(name, help=line, add_help=False)
            continue
        importlib.import_module(f".{name}", __name__).add_parser(sub)  # the listing is not
        # printed when a command is named, so its parser needs no help line
        sub.choices[name].add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show the traceback of an error instead of its one-line message",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = _parser(command if command in SUBCOMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 0
    if unknown:  # the subcommand's usage, not the top-level one
        parser._subparsers._group_actions[0].choices[args.command].error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    args.argv = argv
    from ..training.checkpoint import RunLockedError
    from ._common import UsageError

    user_errors = (UsageError, RunLockedError, ValueError, OSError)  # what input can cause
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"mambakit {args.command}: interrupted", file=sys.stderr)
        return 130
    except user_errors as e:  # anything else is a bug and keeps its traceback
        if args.debug:
            raise
        print(f"mambakit {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
