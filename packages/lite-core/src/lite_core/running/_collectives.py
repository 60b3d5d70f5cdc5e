"""The collectives `LightningLite` offers between its processes: each refused in one sentence
where the processes are not running yet, its input made into tensors on this process's device."""

from __future__ import annotations

from typing import Any, TypeVar, cast

from lite_core.data._gather import gather_for_metrics
from lite_core.errors import MisuseError
from lite_core.move import collective_input
from lite_core.strategies.strategy import Strategy

T = TypeVar("T")


def require_processes(strategy: Strategy, method: str) -> None:
    """Refuse `method()` where the job is distributed but its processes are not running yet."""
    if strategy.is_distributed and not strategy.environment_ready:
        raise MisuseError(f"{method}() needs the processes to be running: call it inside run() or after launch().")


class Collectives:
    """`barrier`, `broadcast`, `all_gather`, `all_reduce` and `gather_for_metrics` through one strategy."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    def barrier(self, name: str | None) -> None:
        require_processes(self._strategy, "barrier")
        self._strategy.barrier(name)

    def broadcast(self, obj: T, src: int) -> T:
        require_processes(self._strategy, "broadcast")
        device, move = self._strategy.root_device, self._strategy.batch_to_device
        received = self._strategy.broadcast(collective_input(obj, device, numbers=False, move=move), src)
        return cast(T, collective_input(received, device, numbers=False, move=move))

    def all_gather(self, data: Any, group: Any, sync_grads: bool) -> Any:
        require_processes(self._strategy, "all_gather")
        data = collective_input(data, self._strategy.root_device, move=self._strategy.batch_to_device)
        return self._strategy.all_gather(data, group=group, sync_grads=sync_grads)

    def all_reduce(self, data: Any, group: Any, reduce_op: str) -> Any:
        require_processes(self._strategy, "all_reduce")
        data = collective_input(data, self._strategy.root_device, move=self._strategy.batch_to_device)
        return self._strategy.all_reduce(data, group=group, reduce_op=reduce_op)

    def gather_for_metrics(self, data: Any) -> Any:
        require_processes(self._strategy, "gather_for_metrics")
        return gather_for_metrics(data, self._strategy)
