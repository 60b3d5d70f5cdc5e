"""The part of an environment that reads the variables torch's launch convention defines."""

from __future__ import annotations

from lite_core.environments._envvars import env_int
from lite_core.environments.environment import ClusterEnvironment


class TorchVariablesEnvironment(ClusterEnvironment):
    """Base of the environments whose launcher starts every process and exports to each the
    variables torch's `env://` initialisation reads: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and
    `MASTER_PORT` (torchrun, Ray Train).

    A subclass names its launcher in `_launcher` (for the messages about a variable it should have
    set) and says how it is detected, where the node rank and the main address are, and how its
    process counts are read and checked.
    """

    #: Who should have set the variables, as the messages name it (`torchrun`).
    _launcher: str = "the launcher"

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_port(self) -> int:
        return env_int("MASTER_PORT", self._launcher)

    def world_size(self) -> int:
        return env_int("WORLD_SIZE", self._launcher)

    def global_rank(self) -> int:
        return env_int("RANK", self._launcher)

    def local_rank(self) -> int:
        return env_int("LOCAL_RANK", self._launcher)
