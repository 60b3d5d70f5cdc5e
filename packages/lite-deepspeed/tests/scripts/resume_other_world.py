"""Resume a 2-rank ZeRO checkpoint with one process, under ZeRO-2 and ZeRO-3: prints the losses.

    python resume_other_world.py CHECKPOINT_DIR

The checkpoint is `zero_train.py`'s, saved after 4 steps; the 2 remaining steps each accumulate
two micro-batches of 4 samples (the two ranks' micro-batches of 2) and clip, as `zero_train.py`
does, so the losses must equal the uninterrupted run's. The last line of output is
`{"during": ..., "after_teardown": ...}`: the launcher variables DeepSpeed reads, inside the
first run and at exit after Lite's teardown.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import deepspeed.ops
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
torch.set_num_threads(1)
FEATURES, LR, MAX_NORM, FIRST_SAMPLE_AFTER_SAVE = 4, 0.05, 0.3, 24
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
ENVIRONMENT: dict = {}


def launcher_variables() -> dict:
    return {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}


def _report_environment() -> None:
    # Registered before Lite's teardowns, so it runs after them (atexit is last-in, first-out).
    print(json.dumps({**ENVIRONMENT, "after_teardown": launcher_variables()}), flush=True)


def remaining_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)  # zero_train.make_data
    x, y = torch.randn(40, FEATURES, generator=generator), torch.randn(40, 1, generator=generator)
    return TensorDataset(x[FIRST_SAMPLE_AFTER_SAVE:], y[FIRST_SAMPLE_AFTER_SAVE:])


class Resume(LightningLite):
    def run(self) -> list[float]:
        torch.manual_seed(99)  # other weights: the checkpoint must bring them back
        model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        model, optimizer = self.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
        batches = iter(self.setup_dataloaders(DataLoader(remaining_data(), batch_size=4)))
        state = {"model": model, "optimizer": optimizer, "step": 0, "note": ""}
        self.load(sys.argv[1], state)
        ENVIRONMENT.setdefault("during", launcher_variables())
        losses = []
        for _ in range(2):
            with self.no_backward_sync(model):
                losses.append(self.micro_step(model, next(batches)))
            losses.append(self.micro_step(model, next(batches)))
            self.clip_gradients(model, optimizer, max_norm=MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        return losses

    def micro_step(self, model, batch) -> float:
        x, y = batch
        loss = nn.functional.mse_loss(model(x).float(), y)
        self.backward(loss, model=model)
        return loss.item()


if __name__ == "__main__":
    atexit.register(_report_environment)
    print(json.dumps({stage: Resume(accelerator="cpu", strategy=stage, devices=1).run()
                      for stage in ("deepspeed_stage_2", "deepspeed_stage_3")}))
