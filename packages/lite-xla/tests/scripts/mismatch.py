"""A sharded `xla_fsdp` checkpoint loaded into a model of other shapes, on 2 replicas.

    python mismatch.py xla_fsdp OUT_JSON FOLDER

Saves `nn.Linear(8, 32, bias=False)` (weight [32, 8]) to FOLDER, then loads it into
`nn.Linear(32, 8, bias=False)` (weight [8, 32]): the same number of elements, so each replica's
padded flat shard has the same shape and torch-xla's `load_state_dict` would copy it without a
word. Writes rank 0's `{"error": ..., "loaded_same": ...}` to OUT_JSON: the error the load raised,
and whether loading the checkpoint back into the saved model's own shapes worked.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # also runs in torch-xla's spawned process
    import _cpu_harness

    _cpu_harness.install()

import _output
import torch

from lite_core import LightningLite
from lite_core.errors import LiteError


class Mismatch(LightningLite):
    def run(self, folder: str) -> dict:
        saved = self._set_up(8, 32)
        self.save({"model": saved}, folder)
        self.barrier()
        try:
            self.load(folder, {"model": self._set_up(32, 8)})
            error = "no error"
        except LiteError as err:
            error = f"{type(err).__name__}: {err}"
        same = self._set_up(8, 32)
        self.load(folder, {"model": same})
        self.barrier()
        return {"error": error, "loaded_same": True}

    def _set_up(self, inputs: int, outputs: int) -> torch.nn.Module:
        self.seed_everything(1)
        model = self.setup(torch.nn.Sequential(torch.nn.Linear(inputs, outputs, bias=False)))
        model(torch.ones(2, inputs, device=self.device)).sum().backward()  # a step marker on each replica
        return model


def main() -> None:
    import _cpu_harness
    from lite_xla.strategies.fsdp import XLAFSDPStrategy

    lite = Mismatch(accelerator="tpu", strategy=XLAFSDPStrategy(**_cpu_harness.STRATEGY_KWARGS), devices=2)
    _output.write(lite, lite.run(sys.argv[3]), sys.argv[2])


if __name__ == "__main__":
    main()
