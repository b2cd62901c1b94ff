"""The `kvfleet` console script (also `python -m cluster`).

Each subcommand lives in its own module under `cluster/commands/` and exposes
`register(subparsers)`, which adds its parser and sets `func` (called with the parsed
args, returns the exit code). Add a command by adding its module name to COMMANDS.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = ["generate", "score", "plan", "kv", "bench", "soak"]


class UsageError(Exception):
    """A user-facing error: bad flag, bad file, bad config value. Printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"cluster.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"kvfleet {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
