"""One `run()` body for `accelerator="cpu", strategy="ddp"` and for `accelerator="tpu"`.

    python parity.py MODE OUT_JSON [CHECKPOINT]      MODE: cpu_ddp | full_batch | xla | xla_fsdp

Each mode trains the same MLP on the same data for one epoch with a global batch of 16 and
writes rank 0's result (per-step losses averaged over the ranks, final weights) to OUT_JSON;
with CHECKPOINT it also saves the trained model there with `save` (under xla_fsdp the
weights in OUT_JSON are rank 0's shards, the checkpoint holds them all).
`full_batch` is one process on the CPU with the whole global batch: the reference.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # also runs in torch-xla's spawned process
    import _cpu_harness

    _cpu_harness.install()

import torch
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

GLOBAL_BATCH = 16


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator))


class Train(LightningLite):
    def run(self, batch_size: int, checkpoint: str | None = None) -> dict:
        self.seed_everything(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = self.setup(model, optimizer)
        loader = self.setup_dataloaders(DataLoader(dataset(), batch_size=batch_size))
        losses = []
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            self.backward(loss)
            optimizer.step()
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        if checkpoint:
            self.save({"model": model}, checkpoint)
        self.barrier()
        ranks = self.all_gather(torch.tensor(self.global_rank)).cpu().tolist()
        weights = self.broadcast([p.detach().cpu().flatten().tolist() for p in model.parameters()])
        return {"losses": losses, "weights": weights, "ranks": ranks, "world_size": self.world_size,
                "strategy": self.strategy.name, "samples_per_step": len(x)}


def make(mode: str) -> Train:
    if mode == "cpu_ddp":
        return Train(accelerator="cpu", strategy="ddp", devices=2)
    if mode == "full_batch":
        return Train(accelerator="cpu", devices=1)
    from lite_xla.strategies.fsdp import XLAFSDPStrategy
    from lite_xla.strategies.xla import XLAStrategy

    # pin_layout=False is part of the CPU harness (see _cpu_harness.py); on TPUs pass strategy="xla".
    strategy = XLAStrategy(pin_layout=False) if mode == "xla" else XLAFSDPStrategy(pin_layout=False)
    return Train(accelerator="tpu", strategy=strategy, devices=2)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    checkpoint = sys.argv[3] if len(sys.argv) > 3 else None
    lite = make(mode)
    result = lite.run(GLOBAL_BATCH if mode == "full_batch" else GLOBAL_BATCH // 2, checkpoint)
    if lite.is_global_zero:
        with open(out, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
