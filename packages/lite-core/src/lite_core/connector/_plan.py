"""The job's plan: what the connector resolved, as one frozen record.

`connect()` builds a `Plan` once, at construction, and `LightningLite` holds it. Each room takes
the parts it needs from it (the models the strategy and the precision, the runs the strategy and
the launcher), so no room reaches a part through another part. Every refusal of a bad choice is
raised while the plan is built; the plan's own check only makes sure that the strategy was wired
to the parts it holds (a strategy's `connect` that forgot `super().connect(...)` is refused here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lite_core.accelerators.accelerator import Accelerator
from lite_core.checkpoint import CheckpointIO
from lite_core.environments import ClusterEnvironment
from lite_core.errors import ConfigurationError
from lite_core.launchers.launcher import Launcher
from lite_core.parallel import MeshLayout
from lite_core.precision.precision import Precision
from lite_core.strategies.strategy import Strategy


@dataclass(frozen=True)
class Plan:
    """The resolved choices of one job: set once by the connector, never changed after.

    Attributes:
        accelerator: the accelerator the processes compute on.
        environment: the cluster environment the processes come from (or will be started in).
        precision: the precision plugin every forward, backward and step goes through; the rooms
            hand it to the strategy's hooks that compose with it (the strategy holds none).
        checkpoint_io: what writes and reads checkpoint files (`plugins=`, else `TorchCheckpointIO`);
            the checkpoint room holds it and hands it to the strategy's save and load.
        strategy: how the model, optimizers and collectives are spread over the processes.
        launcher: what starts the processes; `None` runs the user's code in this process only.
        device_indexes: the indexes of this node's devices the job uses.
        num_nodes: how many machines the job spans.
        mesh_layout: the sizes of the named device mesh the strategy spreads the model over
            (`ModelParallelStrategy`'s resolved `MeshLayout`), `None` for a strategy without one.
    """

    accelerator: Accelerator
    environment: ClusterEnvironment
    precision: Precision
    checkpoint_io: CheckpointIO
    strategy: Strategy
    launcher: Launcher | None
    device_indexes: tuple[int, ...]
    num_nodes: int
    mesh_layout: MeshLayout | None = None

    def __post_init__(self) -> None:
        _check_wired(self.strategy, "accelerator", self.accelerator)
        _check_wired(self.strategy, "environment", self.environment)

    def __getstate__(self) -> dict[str, Any]:
        # The launcher holds processes and threads: a copy sent to a worker runs inside it.
        return {**self.__dict__, "launcher": None}


def _check_wired(strategy: Strategy, part: str, expected: object) -> None:
    if getattr(strategy, part, None) is not expected:
        raise ConfigurationError(
            f"{type(strategy).__name__} does not hold the {part} the connector gave it: a strategy keeps"
            " what it is given (an override of connect() calls super().connect(...))."
        )
