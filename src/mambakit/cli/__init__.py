"""The `mambakit` command: thin subcommands that parse arguments and call the library.

A user's mistake (a bad flag value, a missing or malformed file, a device that is
not there, a run folder in use) is reported in one line naming the flag or file,
with exit status 2 and no traceback; `--debug` shows the traceback. Ctrl-C exits
with status 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..training.checkpoint import RunLockedError
from ._common import UsageError

SUBCOMMANDS = ("demo", "train", "generate", "task")

# what a user's input can cause; anything else is a bug and keeps its traceback
USER_ERRORS = (UsageError, RunLockedError, ValueError, OSError)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="mambakit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f".{name}", __name__)
        module.add_parser(sub)
        sub.choices[name].add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show the traceback of an error instead of its one-line message",
        )
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    args.argv = argv
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"mambakit {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"mambakit {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
