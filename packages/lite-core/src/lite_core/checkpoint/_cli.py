"""`lite consolidate CHECKPOINT OUT`: a sharded checkpoint directory into one `torch.load`-able file."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any) -> None:
    """Add the `consolidate` subcommand."""
    parser = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint (a directory saved under fsdp) into one file",
        description="Read a sharded checkpoint in this process alone and write it as one file that"
        " torch.load and LightningLite.load read under any strategy.",
    )
    parser.add_argument("checkpoint", help="the sharded checkpoint directory")
    parser.add_argument("out", help="the file to write (written atomically)")
    parser.set_defaults(handler=_consolidate, command="consolidate")


def _consolidate(args: argparse.Namespace) -> int:
    from lite_core.checkpoint._sharded import consolidate

    consolidate(args.checkpoint, args.out)
    print(f"wrote {args.out}")
    return 0
