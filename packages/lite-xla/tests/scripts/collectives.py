"""The same `run()` body under `accelerator="cpu", strategy="ddp"` and `accelerator="tpu"`.

    python collectives.py MODE OUT_JSON      MODE: cpu_ddp | xla

Every rank contributes rank-dependent values to `all_reduce`, `all_gather` and `broadcast`,
reads its shard of a dataloader, and rank 0's result is written to OUT_JSON by the caller.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # also runs in torch-xla's spawned process
    import _cpu_harness

    _cpu_harness.install()

import _output
import torch
from torch.utils.data import DataLoader

from lite_core import LightningLite


class Collectives(LightningLite):
    def run(self, scale: float) -> dict:
        rank = self.global_rank
        loader = self.setup_dataloaders(DataLoader(list(range(8)), batch_size=2))
        seen = [int(v) for batch in loader for v in batch.cpu()]
        total = self.all_reduce(torch.tensor(scale * (rank + 1)), reduce_op="sum")
        mean = self.all_reduce(torch.tensor([scale * (rank + 1), 1.0]), reduce_op="mean")
        largest = self.all_reduce(torch.tensor(float(rank)), reduce_op="max")
        gathered = self.all_gather(torch.tensor([rank, 10 * rank]))
        message = self.broadcast({"from": rank, "text": "hello"} if rank == 0 else None)
        self.barrier()
        return {"world_size": self.world_size, "sum": total.item(), "mean": mean.cpu().tolist(),
                "max": largest.item(), "gathered": gathered.cpu().tolist(), "message": message,
                "seen": self.all_gather(torch.tensor(seen)).cpu().tolist(), "strategy": self.strategy.name}


def make(mode: str) -> Collectives:
    if mode == "cpu_ddp":
        return Collectives(accelerator="cpu", strategy="ddp", devices=2)
    import _cpu_harness  # its settings are for XLA's CPU device only; on TPUs: strategy="xla"
    from lite_xla.strategies.xla import XLAStrategy

    return Collectives(accelerator="tpu", strategy=XLAStrategy(**_cpu_harness.STRATEGY_KWARGS), devices=2)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    lite = make(mode)
    _output.write(lite, lite.run(scale=1.5), out)


if __name__ == "__main__":
    main()
