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
    parser.add_argument("checkpoint", help="the sharded checkpoint directory (a path or an fsspec URL)")
    parser.add_argument("out", help="the file to write (written atomically; a path or an fsspec URL)")
    parser.set_defaults(handler=_consolidate, command="consolidate")


def _consolidate(args: argparse.Namespace) -> int:
    from lite_core.checkpoint._sharded import consolidate
    from lite_core.checkpoint.stores import as_local, check_path

    source, out = as_local(args.checkpoint), as_local(args.out)
    for path in (source, out):  # a URL's fsspec back end must be there before anything is read or written
        check_path(path)
    consolidate(source, out)
    print(f"wrote {args.out}")
    return 0
