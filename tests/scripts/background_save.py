"""Background checkpoints (`save(..., blocking=False)`) in a 2-process job.

    python background_save.py STRATEGY OUT_DIR     (STRATEGY: ddp, ddp_spawn, fsdp, fsdp_full for one-file fsdp saves, or
    model_parallel: dp1 x tp2, sharded)

1. Every rank saves in the background, then trains 3 steps that change every weight, waits, and
   loads the checkpoint back into the model: it must hold the weights of the moment of the call
   (prints `rank R state at the call: True`).
2. A background save whose write fails on rank 0 only (its CheckpointIO raises for paths that
   contain "broken"): every rank must raise a CheckpointError at the next `save` and, for a
   second such save, at `wait_for_checkpoint()` (prints `rank R at save: MESSAGE` and
   `rank R at wait: MESSAGE`).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from lite_core import LightningLite
from lite_core.checkpoint import TorchCheckpointIO
from lite_core.errors import CheckpointError

torch.set_num_threads(1)


class BrokenDiskIO(TorchCheckpointIO):
    """Fails on rank 0 for every path that contains "broken", as a full disk would."""

    def save(self, checkpoint, path):  # type: ignore[no-untyped-def]
        if "broken" in os.fspath(path):
            raise OSError(28, "No space left on device")
        super().save(checkpoint, path)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Job(LightningLite):
    def run(self, out_dir: str) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        self.step(model, optimizer)
        at_call = {k: local(v).detach().clone() for k, v in model.state_dict().items()}
        path = os.path.join(out_dir, "ckpt")
        self.save({"model": model, "optimizer": optimizer, "step": 1}, path, blocking=False)
        for _ in range(3):
            self.step(model, optimizer)
        self.wait_for_checkpoint()
        self.load(path, {"model": model, "optimizer": optimizer})
        same = all(torch.equal(local(v), at_call[k]) for k, v in model.state_dict().items())
        print(f"rank {self.global_rank} state at the call: {same}", flush=True)

        broken = os.path.join(out_dir, "broken")
        for when in ("save", "wait"):
            self.save({"model": model}, broken, blocking=False)
            self.step(model, optimizer)
            try:
                if when == "save":
                    self.save({"model": model}, path, blocking=False)
                else:
                    self.wait_for_checkpoint()
            except CheckpointError as err:
                print(f"rank {self.global_rank} at {when}: {err}", flush=True)
        self.wait_for_checkpoint()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        self.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()


def strategy(name: str) -> object:
    if name == "fsdp_full":
        from lite_core.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(state_dict_type="full")
    if name == "model_parallel":
        from lite_core.strategies import ModelParallelStrategy

        return ModelParallelStrategy(tensor_parallel, tensor_parallel_size=2)
    return name


def tensor_parallel(model: nn.Module, device_mesh: object) -> nn.Module:
    """The first layer column-wise, the last row-wise over the mesh's tensor-parallel dimension."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


if __name__ == "__main__":
    Job(accelerator="cpu", strategy=strategy(sys.argv[1]), devices=2, plugins=BrokenDiskIO()).run(sys.argv[2])
