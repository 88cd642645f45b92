"""The `mambakit` command: thin subcommands that parse arguments and call the library."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("demo", "train", "generate", "bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mambakit", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            continue  # a subcommand not shipped in this build
        module.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
