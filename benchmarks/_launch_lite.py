"""Launch benchmark, Lite side: `python _launch_lite.py` trains a tiny model on 2 CPU ranks and exits.

Lite (`strategy="ddp", devices=2`) starts the second rank itself. The work matches
`_launch_plain.py` exactly: gloo process group, DDP-wrapped Linear(32,32), `--steps` SGD steps on
batch 8, a final barrier and process-group teardown (Lite does the last two at exit).
"""

from __future__ import annotations

import argparse

import torch

from _common import MODELS, make_optimizer, timed_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2)
    lite.launch()
    spec = MODELS["tiny"]
    model = spec.build(seed=0)
    model, optimizer = lite.setup(model, make_optimizer(model))
    timed_steps(model, optimizer, spec.batches(seed=1 + lite.global_rank), args.steps, lite.backward)


if __name__ == "__main__":
    main()
