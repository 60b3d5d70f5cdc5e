"""Sharded DDP through fairscale: each process keeps the optimizer state of its share of the
parameters (OSS), and `ShardedDataParallel` sends each gradient to the process that owns it.

fairscale is imported only when one of these strategies is constructed.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, ContextManager

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core.checkpoint import CheckpointIO, to_state
from lite_core.checkpoint._rank_zero import on_rank_zero
from lite_core.errors import BackendNotInstalledError, ConfigurationError, MisuseError
from lite_core.precision.names import PrecisionSupport
from lite_core.precision.precision import Precision
from lite_core.strategies.ddp import DDPStrategy
from lite_core._install import install_hint


class DDPShardedStrategy(DDPStrategy):
    """`strategy="ddp_sharded"`: fairscale's OSS + ShardedDataParallel; re-runs the script like `ddp`.

    Gradients are reduced one parameter at a time (fairscale's `reduce_buffer_size=0`): with its
    default bucketing, an optimizer that sets gradients to `None` in `zero_grad()` (PyTorch's
    default) trains to different weights than one process.

    Args:
        timeout: how long a collective waits for the other ranks (see `DDPStrategy`).
        process_group_backend: overrides the accelerator's `torch.distributed` backend.
        **sharded_kwargs: passed on to `fairscale.nn.data_parallel.ShardedDataParallel`.
    """

    name = "ddp_sharded"
    supported_process_group_backends = frozenset({"gloo", "nccl"})  # what fairscale talks
    requirements = {"fairscale": install_hint("fairscale")}
    precision_support = PrecisionSupport(families=frozenset({"true", "mixed"}), mixed_dtypes=frozenset({torch.bfloat16}))
    stages_checkpoints = False  # `save_checkpoint` consolidates the sharded optimizer state first

    def __init__(self, timeout: float | timedelta | None = None, process_group_backend: str | None = None,
                 **sharded_kwargs: Any) -> None:
        if not _fairscale_installed():
            raise BackendNotInstalledError(
                f"strategy={self.name!r} needs fairscale, which is not installed: run"
                f" `{install_hint('fairscale')}`."
            )
        if sharded_kwargs.get("reduce_buffer_size", 0) != 0:
            raise ConfigurationError(
                f"strategy={self.name!r} reduces gradients unbucketed because fairscale's buckets give"
                " wrong weights when zero_grad() sets gradients to None: drop reduce_buffer_size."
            )
        super().__init__(timeout=timeout, process_group_backend=process_group_backend)
        self._sharded_kwargs = {**sharded_kwargs, "reduce_buffer_size": 0}

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        raise MisuseError(
            f"strategy={self.name!r} wraps the model together with its optimizers: call"
            " setup(model, optimizer) instead of setup_module()."
        )

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise MisuseError(
            f"strategy={self.name!r} wraps the model together with its optimizers: call"
            " setup(model, optimizer) instead of setup_optimizers()."
        )

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], *,
                                    precision: Precision) -> tuple[nn.Module, list[Optimizer]]:
        from fairscale.nn.data_parallel import ShardedDataParallel

        if not optimizers:
            self.setup_module(module, precision=precision)
        sharded = [_shard_optimizer(o) for o in optimizers]
        return ShardedDataParallel(module, sharded, **self._sharded_kwargs), sharded

    def no_backward_sync(self, module: nn.Module) -> ContextManager[Any]:
        no_sync = getattr(module, "no_sync", None)
        return no_sync() if callable(no_sync) else nullcontext()

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True, *,
                            precision: Precision) -> torch.Tensor:
        # Each process holds the reduced gradients of its own shard only: OSS adds the norms up.
        precision.unscale_gradients(optimizer)
        return optimizer.clip_grad_norm(max_norm, norm_type=norm_type)  # type: ignore[attr-defined]

    def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> None:
        # Gather each optimizer's shards on rank 0 first; `state_dict()` works only there.
        for value in content.values():
            inner = getattr(value, "optimizer", value)
            if hasattr(inner, "consolidate_state_dict"):
                inner.consolidate_state_dict(recipient_rank=0)
        on_rank_zero(self, path, lambda: checkpoint_io.save(to_state(content, precision), path))


class DDPShardedSpawnStrategy(DDPShardedStrategy):
    """`strategy="ddp_sharded_spawn"`: like `ddp_sharded`, with every rank started by spawn."""

    name = "ddp_sharded_spawn"
    start_method = "spawn"


def _shard_optimizer(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer rebuilt as an OSS optimizer of the same class and settings."""
    from fairscale.optim import OSS

    groups = [dict(group) for group in optimizer.param_groups]
    return OSS(groups, optim=type(optimizer), **optimizer.defaults)


def _fairscale_installed() -> bool:
    try:
        return importlib.util.find_spec("fairscale") is not None
    except ValueError:  # `sys.modules["fairscale"] = None`: made unimportable on purpose
        return False
