"""The `kvfleet` console script (also `python -m cluster`).

Each subcommand lives in its own module under `cluster/commands/` and exposes
`register(subparsers)`, which adds its parser and sets `func` (called with the parsed
args, returns the exit code) and, optionally, `interrupted` (called with the args after a
Ctrl-C: what the interrupted run left, e.g. which results are kept). Add a command by
adding its module name to COMMANDS.

Ctrl-C (KeyboardInterrupt) ends any command with one line on stderr and exit status 130
(128 + SIGINT, as shells report it), not a traceback. It is caught here only: the jobs let
it unwind, so that their `finally` blocks write what they have finished.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys

COMMANDS = ["generate", "score", "plan", "kv", "bench", "soak"]


class UsageError(Exception):
    """A user-facing error: bad flag, bad file, bad config value. Printed without a traceback."""


class Stopped(BaseException):
    """SIGTERM arrived (`ray job stop`, kill, a preempted node). A BaseException, as
    KeyboardInterrupt is: no `except Exception` of a step takes it for a failed step."""


def stop_on_sigterm(signum, frame) -> None:
    """Stop as Ctrl-C does, so that a command's `finally` keeps what it finished (generate:
    its rows, where the default action ended the process at once and lost up to flush_every
    of them; soak: its finished rounds). A second SIGTERM ends it at once. (Once generate has
    called ray.init, Ray's own driver handler, sys.exit(15), replaces this one: it unwinds
    the same `finally` blocks; the soak sets this one again after ray.init.)"""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Stopped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"cluster.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = None  # (a Ctrl-C may come while the commands are still being imported)
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"kvfleet {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        left = getattr(args, "interrupted", None)
        print(f"kvfleet{' ' + args.command if args else ''}: interrupted"
              + (f"; {left(args)}" if left else ""), file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
