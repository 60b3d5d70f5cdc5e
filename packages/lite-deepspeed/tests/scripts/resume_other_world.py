"""Load a 2-rank ZeRO checkpoint with one process: prints the error.

    python resume_other_world.py CHECKPOINT_DIR
"""

from __future__ import annotations

import sys

import deepspeed.ops
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import CheckpointError

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class Resume(LightningLite):
    def run(self) -> str:
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        model, optimizer = self.setup(model, torch.optim.Adam(model.parameters()))
        try:
            self.load(sys.argv[1], {"model": model, "optimizer": optimizer})
        except CheckpointError as err:
            return str(err)
        return "no error"


if __name__ == "__main__":
    print(Resume(accelerator="cpu", strategy="deepspeed_stage_2", devices=1).run())
