"""What the lower layers ask of the strategy that hands itself down to them, as typing protocols.

Imports go one way (see docs/architecture.md): wrappers, checkpoint code and launchers sit below
the strategies and never import `lite_core.strategies`, not even for a type hint. A strategy
passes itself to them (`LiteModule(..., strategy)`, `to_state(content, strategy)`); these
protocols name the part of it that they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from lite_core.precision.precision import Precision


class Ranks(Protocol):
    """The collectives a checkpoint uses to tell every rank how a write went."""

    @property
    def global_rank(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any: ...

    def batch_to_device(self, batch: Any) -> Any: ...


class HasPrecision(Protocol):
    """An object whose precision plugin is saved and restored with a checkpoint."""

    @property
    def precision(self) -> Precision: ...


class StrategyLike(Ranks, HasPrecision, Protocol):
    """A strategy as the set-up model, optimizer and loader, and the launchers, see it: every
    `lite_core.plugins.Strategy` is one."""

    @property
    def name(self) -> str: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def is_distributed(self) -> bool: ...

    def __getattr__(self, name: str) -> Any: ...


class ShardsCheckpoints(Ranks, HasPrecision, Protocol):
    """A strategy whose checkpoints hold sharded modules and optimizers (`fsdp`, `model_parallel`),
    as `lite_core.checkpoint`'s torch distributed checkpoint code sees it."""

    @property
    def checkpoint_io(self) -> Any: ...

    def module_of(self, optimizer: Any) -> Any: ...

    def whole_module_keys(self, module: Any) -> list[str] | None: ...

    def parameter_names_before_split(self, optimizer: Any) -> list[list[str]] | None: ...
