"""The `mambakit` command: thin subcommands that parse arguments and call the library."""

from __future__ import annotations

import argparse
import sys

from . import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mambakit", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (demo,):
        module.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
