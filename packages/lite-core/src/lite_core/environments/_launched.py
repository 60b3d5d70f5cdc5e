"""What every environment whose launcher started the processes shares: the ranks read from the
variables the launcher exports, and the checks of its counts against `devices` and `num_nodes`."""

from __future__ import annotations

from typing import ClassVar

from lite_core.environments._envvars import env_int
from lite_core.environments.environment import ClusterEnvironment
from lite_core.errors import ConfigurationError


class LaunchedEnvironment(ClusterEnvironment):
    """Base of the environments whose launcher or scheduler starts every process and exports its
    ranks as environment variables (torchrun, Ray Train, SLURM, LSF, MPI, Kubeflow).

    A subclass names its launcher in `_launcher` (for the messages about a variable it should have
    set), the variables in `_world_variable`, `_rank_variable` and `_local_rank_variable` (torch's
    `env://` names by default), and says how it is detected, where the node rank and the main
    address are, and how its process counts are read and checked (with `_require_count` and
    `_require_world`, so that every launcher words a disagreement the same way).
    """

    #: Who should have set the variables, as the messages name it (`torchrun`).
    _launcher: ClassVar[str] = "the launcher"
    _world_variable: ClassVar[str] = "WORLD_SIZE"
    _rank_variable: ClassVar[str] = "RANK"
    _local_rank_variable: ClassVar[str] = "LOCAL_RANK"

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_port(self) -> int:
        return env_int("MASTER_PORT", self._launcher)

    def world_size(self) -> int:
        return env_int(self._world_variable, self._launcher)

    def global_rank(self) -> int:
        return env_int(self._rank_variable, self._launcher)

    def local_rank(self) -> int:
        return env_int(self._local_rank_variable, self._launcher)

    @staticmethod
    def _require_count(found: int, asked: int, keyword: str, started: str, fix: str | None = None) -> None:
        """Refuse `LightningLite(keyword=asked)` where the launcher `started` (its words) `found`;
        `fix` is the launcher's own option that would agree with `asked`."""
        if found != asked:
            other = f" or {fix}" if fix else ""
            raise ConfigurationError(f"{started} but LightningLite({keyword}={asked}) asks for {asked}: make them"
                                     f" agree, e.g. {keyword}={found}{other}.")

    def _require_world(self, num_devices: int, num_nodes: int, started: str, fix: str) -> None:
        """Refuse `devices * num_nodes` that is not the world size the launcher `started` (its words)."""
        expected = num_devices * num_nodes
        if self.world_size() != expected:
            raise ConfigurationError(f"{started} but LightningLite(devices={num_devices}, num_nodes={num_nodes})"
                                     f" expects {expected}: make them agree, e.g. {fix}.")
