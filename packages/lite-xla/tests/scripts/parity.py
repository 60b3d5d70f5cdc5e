"""One `run()` body for `accelerator="cpu", strategy="ddp"` and for `accelerator="tpu"`.

    python parity.py MODE OUT_JSON [CHECKPOINT]      MODE: cpu_ddp | full_batch | xla | xla_fsdp

Each mode trains the same MLP on the same data for one epoch with a global batch of 16 and
writes rank 0's result (per-step losses averaged over the ranks, gradient norms, learning
rates, final weights) to OUT_JSON. The optimizer has two parameter groups with their own
learning rates, holds momentum from one CPU step before `setup`, and has a StepLR scheduler
built before `setup`; every step clips the gradients to a norm well below theirs. A strategy
that loses a group's hyperparameters, detaches the scheduler, drops or mis-shards the optimizer
state, or clips each replica (or shard) by its own norm trains differently;
with CHECKPOINT it also saves the trained model there with `save` (under xla_fsdp the
weights in OUT_JSON are rank 0's shards, the checkpoint holds them all).
`full_batch` is one process on the CPU with the whole global batch: the reference.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # also runs in torch-xla's spawned process
    import _cpu_harness

    _cpu_harness.install()

import _output
import torch
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

GLOBAL_BATCH = 16
#: torch-xla's FSDP pads each parameter to a multiple of 128 elements per replica: the first
#: layer's 4 x 64 weights are split between 2 replicas, so each holds part of the gradient.
HIDDEN = 64
#: Far below the gradients' norm (about 1 at every step): every step is clipped.
MAX_NORM = 0.05


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator))


def warm_up(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step on the CPU with the whole dataset, so the optimizer holds state before `setup`."""
    x, y = dataset().tensors
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


class Train(LightningLite):
    def run(self, batch_size: int, checkpoint: str | None = None) -> dict:
        self.seed_everything(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
        optimizer = torch.optim.SGD([{"params": model[0].parameters()},
                                     {"params": model[2].parameters(), "lr": 0.5}], lr=1.0, momentum=0.5)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)  # before setup
        warm_up(model, optimizer)  # the optimizer holds momentum before setup
        model, optimizer = self.setup(model, optimizer)
        loader = self.setup_dataloaders(DataLoader(dataset(), batch_size=batch_size))
        losses, norms, lrs = [], [], []
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            self.backward(loss)
            norms.append(self.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
            lrs.append([group["lr"] for group in optimizer.param_groups])
            optimizer.step()
            scheduler.step()
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        if checkpoint:
            self.save({"model": model}, checkpoint)
        self.barrier()
        ranks = self.all_gather(torch.tensor(self.global_rank)).cpu().tolist()
        weights = self.broadcast([p.detach().cpu().flatten().tolist() for p in model.parameters()])
        return {"losses": losses, "norms": norms, "lrs": lrs, "weights": weights, "ranks": ranks, "world_size": self.world_size,
                "strategy": self.strategy.name, "samples_per_step": len(x)}


def make(mode: str) -> Train:
    if mode == "cpu_ddp":
        return Train(accelerator="cpu", strategy="ddp", devices=2)
    if mode == "full_batch":
        return Train(accelerator="cpu", devices=1)
    import _cpu_harness  # its settings are for XLA's CPU device only; on TPUs pass strategy="xla"
    from lite_xla.strategies.fsdp import XLAFSDPStrategy
    from lite_xla.strategies.xla import XLAStrategy

    strategy_class = XLAStrategy if mode == "xla" else XLAFSDPStrategy
    strategy = strategy_class(**_cpu_harness.STRATEGY_KWARGS)
    return Train(accelerator="tpu", strategy=strategy, devices=2)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    checkpoint = sys.argv[3] if len(sys.argv) > 3 else None
    lite = make(mode)
    _output.write(lite, lite.run(GLOBAL_BATCH if mode == "full_batch" else GLOBAL_BATCH // 2, checkpoint), out)


if __name__ == "__main__":
    main()
