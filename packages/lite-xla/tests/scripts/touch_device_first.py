"""Uses the XLA device before Lite starts the replicas, which torch-xla cannot undo.

    python touch_device_first.py
"""

from __future__ import annotations

import torch
import torch_xla

from lite_core import LightningLite
from lite_core.errors import MisuseError

if __name__ == "__main__":
    weights = torch.zeros(2).to(torch_xla.device())  # starts the runtime in this process
    lite = LightningLite(accelerator="tpu", devices=2)
    try:
        lite.launch(lambda lite: lite.global_rank)
    except MisuseError as err:
        print(f"MisuseError: {err}")
