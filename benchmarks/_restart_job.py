"""Restart benchmark: `lite run --max-restarts 1 --nproc-per-node 2 _restart_job.py OUT_DIR` (or
the same under torchrun). Rank 1 dies (`os._exit(3)`) at step 3 of the first attempt after writing
the time to OUT_DIR/died_at; on the next attempt every rank writes OUT_DIR/trained_rank{r} with the
time its first training step (a DDP all-reduce with every rank) returned. The recovery time is
the latest of those minus died_at.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from _common import MODELS, make_optimizer


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2)
    lite.launch()
    spec = MODELS["tiny"]
    model = spec.build(seed=0)
    model, optimizer = lite.setup(model, make_optimizer(model))
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    for step, (x, y) in enumerate(spec.batches(seed=1 + lite.global_rank) * 2):
        if not restarted and step == 3 and lite.global_rank == 1:
            (out / "died_at").write_text(repr(time.time()))
            os._exit(3)
        optimizer.zero_grad()
        lite.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if restarted and step == 0:
            (out / f"trained_rank{lite.global_rank}").write_text(repr(time.time()))


if __name__ == "__main__":
    main()
