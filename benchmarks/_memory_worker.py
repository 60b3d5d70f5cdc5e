"""Worker: peak memory (max RSS) of one single-process training loop, plain or Lite.

Started by `run.py` once per arm and repetition (a fresh process, so the peak is this arm's own).
Prints one JSON line: the RSS after imports and set-up, and the peak RSS after the loop, in MiB.
The plain arm never imports `lite_core`.
"""

from __future__ import annotations

import argparse
import json

import torch

from _common import MODELS, make_optimizer, max_rss_mib, timed_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arm", choices=("plain", "lite"), required=True)
    parser.add_argument("--model", default="mlp2048")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    model = spec.build(seed=0)
    optimizer = make_optimizer(model)
    backward = None
    if args.arm == "lite":
        from lite_core import LightningLite

        lite = LightningLite(accelerator="cpu", devices=1)
        model, optimizer = lite.setup(model, optimizer)
        backward = lite.backward
    batches = spec.batches()
    after_setup = max_rss_mib()
    if backward is None:
        timed_steps(model, optimizer, batches, args.steps)
    else:
        timed_steps(model, optimizer, batches, args.steps, backward)
    print(json.dumps({"arm": args.arm, "setup_rss_mib": after_setup, "peak_rss_mib": max_rss_mib()}))


if __name__ == "__main__":
    main()
