"""`lite-deepspeed-convert CHECKPOINT_DIR OUTPUT_FILE`: one full fp32 state dict from ZeRO shards."""

from __future__ import annotations

import argparse
import sys

from lite_core.plugins import LiteError


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lite-deepspeed-convert` command."""
    parser = argparse.ArgumentParser(
        prog="lite-deepspeed-convert",
        description="Write the full fp32 state dict of a DeepSpeed checkpoint directory saved by Lite,"
                    " loadable with model.load_state_dict(torch.load(OUTPUT_FILE)).",
    )
    parser.add_argument("checkpoint_dir", help="the directory that lite.save() wrote")
    parser.add_argument("output_file", help="the state-dict file to write")
    parser.add_argument("--tag", default=None, help="the checkpoint tag to convert (default: the latest)")
    args = parser.parse_args(argv)
    from lite_deepspeed.convert import convert_to_fp32_state_dict

    try:
        state = convert_to_fp32_state_dict(args.checkpoint_dir, args.output_file, tag=args.tag)
    except LiteError as err:
        print(f"lite-deepspeed-convert: {err}", file=sys.stderr)
        return 2
    print(f"Wrote {len(state)} tensors to {args.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
