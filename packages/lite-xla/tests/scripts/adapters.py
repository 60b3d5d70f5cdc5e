"""An adapters-only checkpoint (`trainable_state(model)` with the optimizer) on 2 XLA replicas.

    python adapters.py MODE OUT_JSON FOLDER        # MODE: xla or xla_fsdp

A frozen base layer and a trained one (an adapter's part) train two steps with SGD and momentum;
the checkpoint is taken after the first. A model whose trained layer starts from another draw loads
it and trains the second step. Both replicas train on the same batch (so one plain process trains
as they do). Writes rank 0's `{"keys": ..., "trained": ..., "resumed_equal": ..., "moved": ...,
"base_untouched": ...}` to OUT_JSON.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # also runs in torch-xla's spawned process
    import _cpu_harness

    _cpu_harness.install()

import _output
import torch
from _adapters_model import build

from lite_core import LightningLite


class Adapters(LightningLite):
    def run(self, folder: str) -> dict:
        model, optimizer = self._set_up(adapter_seed=2)
        initial = self.full_state_dict(model)
        self._step(model, optimizer, 0)
        self.save({"adapters": self.trainable_state(model), "optimizer": optimizer}, folder)
        keys = sorted(self.load(folder)["adapters"])
        self._step(model, optimizer, 1)
        trained = self.full_state_dict(model, trainable_only=True)
        whole = self.full_state_dict(model)
        other, other_optimizer = self._set_up(adapter_seed=7)
        self.load(folder, {"adapters": self.trainable_state(other), "optimizer": other_optimizer})
        self._step(other, other_optimizer, 1)
        resumed = self.full_state_dict(other, trainable_only=True)
        return {"keys": keys, "trained": {k: v.tolist() for k, v in trained.items()},
                "resumed_equal": sorted(resumed) == sorted(trained) and all(torch.equal(resumed[k], trained[k]) for k in trained),
                "moved": max((trained[k] - initial[k]).abs().max().item() for k in trained) if trained else 0.0,
                "base_untouched": torch.equal(whole["0.weight"], initial["0.weight"]) if whole else False}

    def _set_up(self, adapter_seed: int) -> tuple:
        self.seed_everything(1)
        model = build(adapter_seed)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return self.setup(model, torch.optim.SGD(trainable, lr=0.1, momentum=0.9))

    def _step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        generator = torch.Generator().manual_seed(10 + step)
        x = torch.randn(4, 8, generator=generator).to(self.device)
        y = torch.randn(4, 4, generator=generator).to(self.device)
        optimizer.zero_grad()
        self.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()


def main() -> None:
    import _cpu_harness
    from lite_xla.strategies.fsdp import XLAFSDPStrategy
    from lite_xla.strategies.xla import XLAStrategy

    strategy = (XLAFSDPStrategy if sys.argv[1] == "xla_fsdp" else XLAStrategy)(**_cpu_harness.STRATEGY_KWARGS)
    lite = Adapters(accelerator="tpu", strategy=strategy, devices=2)
    _output.write(lite, lite.run(sys.argv[3]), sys.argv[2])


if __name__ == "__main__":
    main()
