"""The `lite` command line: `lite run` launches a script on every rank, `lite env` describes the
install, `lite consolidate` turns a sharded checkpoint into one file.

Each subcommand lives in its own module with a `register(commands)` function that adds its parser
and sets `handler` (a function taking the parsed arguments and returning the exit code). Adding a
subcommand is one module plus one line in `_COMMANDS`. Heavy imports (torch, backends) stay inside
the handlers, so `lite --help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lite_core.__about__ import __version__

#: Modules that each register one subcommand, in the order `lite --help` lists them.
_COMMANDS: tuple[str, ...] = (
    "lite_core.cli._run",
    "lite_core.cli._env",
    "lite_core.checkpoint._cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The `lite` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="lite", description="Launch and inspect Lite training jobs.")
    parser.add_argument("--version", action="version", version=f"lite-core {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        importlib.import_module(module).register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lite` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # a LiteError (or a bad path): one line, no traceback
        from lite_core.errors import LiteError

        if not isinstance(err, (LiteError, OSError)):
            raise
        sys.stderr.write(f"lite {args.command}: error: {err}\n")
        return 2
