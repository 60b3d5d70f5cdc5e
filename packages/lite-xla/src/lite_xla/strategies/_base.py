"""What every XLA strategy does: device loader, batches, optimizers, graph cuts, CPU checkpoints."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core.plugins import CheckpointIO, Precision, Strategy, on_writing_ranks, to_state
from lite_xla.accelerator import XLA_PRECISION_SUPPORT
from lite_xla.strategies import _device


class XLAStrategyBase(Strategy):
    """Shared by the XLA strategies; the loop needs no XLA-specific call.

    Batches come through torch-xla's parallel loader, each optimizer step ends the graph, and
    optimizers created before `setup()` are pointed at the parameters on the device (moving a
    module to an XLA device replaces its `Parameter` objects, unlike a move between CUDA/CPU).
    """

    supported_accelerators: ClassVar[frozenset[str] | None] = frozenset({"tpu"})
    precision_support = XLA_PRECISION_SUPPORT
    moves_batches_plainly: ClassVar[bool] = False  # `batch_to_device` moves onto the XLA device
    steps_optimizers_plainly: ClassVar[bool] = False  # `optimizer_step` reduces gradients, cuts the graph
    stages_checkpoints: ClassVar[bool] = False  # `save_checkpoint` writes per host, with no staging
    #: torch-xla writes and reads checkpoints on local files only (`xm.save`, its sharded format):
    #: Lite refuses an fsspec URL before anything is written (docs/cloud-checkpoints.md).
    checkpoint_urls: ClassVar[bool] = False
    loads_safetensors: ClassVar[bool] = False  # the engine holds the weights its own way

    def __init__(self) -> None:
        super().__init__()
        #: id(parameter before the move) -> (that parameter, its replacement on the device)
        self._moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_moved"] = {}
        return state

    def module_to_device(self, module: nn.Module) -> nn.Module:
        before = list(module.parameters())
        module = module.to(self.root_device)
        for old, new in zip(before, module.parameters()):
            if old is not new:
                self._moved[id(old)] = (old, new)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        _device.relink(optimizer, self._moved)
        return optimizer

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        return _device.device_loader(dataloader, self.root_device)

    def batch_to_device(self, batch: Any) -> Any:
        return _device.to_device(batch, self.root_device)

    def optimizer_step(self, optimizer: Optimizer, *, precision: Precision, **kwargs: Any) -> Any:
        self.reduce_gradients(optimizer)
        result = precision.optimizer_step(optimizer, **kwargs)
        _device.cut_graph()
        return result

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Combine the replicas' gradients before the step (nothing to do on one device)."""

    def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> None:
        """The first replica of each host writes the file (replicas hold the same state), so
        that every host of a TPU pod can load it without shared storage; on shared storage the
        hosts' atomic writes of the same content replace each other. If a write fails, every
        replica raises."""
        state = _device.to_cpu(to_state(content, precision))
        on_writing_ranks(self, path, lambda: checkpoint_io.save(state, path), writes=self.local_rank == 0)
