"""What the lower floors ask of the strategy that hands itself down to them, as typing protocols.

Imports go one way (see docs/architecture.md): the set-up model and optimizer, checkpoint code
and launchers sit below the strategies and never import `lite_core.strategies`, not even for a
type hint. A strategy passes itself to them (`LiteModule(..., strategy)`, `save_full(strategy,
...)`, `MultiprocessingLauncher(strategy, ...)`); each protocol here names exactly the members that
one of them calls, and nothing else, so a type checker reports a call outside it. Every
`lite_core.plugins.Strategy` is each of them (`packages/lite-core/tests/test_roles.py`). None names
a precision: the job's is handed to the strategy's calls beside the strategy, never read from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch import nn
    from torch.optim import Optimizer

    from lite_core.environments.environment import ClusterEnvironment
    from lite_core.precision.precision import Precision


class Named(Protocol):
    """A strategy as a message names it (`strategy='ddp'`)."""

    @property
    def name(self) -> str: ...


class Ranks(Protocol):
    """The collectives a checkpoint uses to tell every rank how a write went."""

    @property
    def global_rank(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any: ...

    def batch_to_device(self, batch: Any) -> Any: ...


class StepsOptimizers(Protocol):
    """A strategy as the set-up optimizer (`lite_core.model.optimizer`) sees it."""

    @property
    def steps_optimizers_plainly(self) -> bool: ...

    def optimizer_step(self, optimizer: Optimizer, *, precision: Precision, **kwargs: Any) -> Any: ...


class RoutesModule(Named, Protocol):
    """A strategy as the set-up model (`lite_core.model._module`) routes its calls through it."""

    def load_module_state_dict(self, module: nn.Module, state_dict: Any, strict: bool = True,
                               assign: bool = False) -> Any: ...

    def module_named_parameters(self, module: nn.Module, forward_module: nn.Module, prefix: str = "",
                                recurse: bool = True, remove_duplicate: bool = True
                                ) -> Iterator[tuple[str, nn.Parameter]]: ...

    def call_module_method(self, forward_module: nn.Module, module: nn.Module, name: str, *args: Any,
                           **kwargs: Any) -> Any: ...


class SpawnsRanks(Named, Protocol):
    """A strategy as `lite_core.launchers.multiprocessing` starts its ranks and ends them."""

    @property
    def environment(self) -> ClusterEnvironment | None: ...

    @property
    def device_indexes(self) -> list[int]: ...

    @property
    def global_rank(self) -> int: ...

    def teardown(self, failed: bool = False) -> None: ...


class ShardsCheckpoints(Named, Ranks, Protocol):
    """A strategy whose checkpoints hold sharded modules and optimizers (`fsdp`, `model_parallel`),
    as `lite_core.checkpoint`'s torch distributed checkpoint code sees it (the checkpoint IO and
    the precision are handed to that code beside it: the job's, not the strategy's)."""

    def module_of(self, optimizer: Any) -> Any: ...

    def whole_module_keys(self, module: Any) -> list[str] | None: ...

    def parameter_names_before_split(self, optimizer: Any) -> list[list[str]] | None: ...
