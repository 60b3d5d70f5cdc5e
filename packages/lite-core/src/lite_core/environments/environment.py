"""The cluster environment: who started the processes and where each one sits."""

from __future__ import annotations

from abc import ABC, abstractmethod


class ClusterEnvironment(ABC):
    """Reads ranks, world size and the main address from whatever started the processes.

    Subclasses describe one launcher or scheduler (torchrun, SLURM, LSF, MPI, Kubeflow, or Lite's
    own local launcher). `detect()` tells from the process environment whether it applies.
    """

    #: Name shown in messages and by `lite env`.
    name: str = "environment"

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """True when something other than Lite started every process of the job."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Address of the process with global rank 0."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port on the main address used to form the process group."""

    @staticmethod
    @abstractmethod
    def detect() -> bool:
        """Whether the current process runs under this environment."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the job."""

    @abstractmethod
    def global_rank(self) -> int:
        """Rank of this process across all nodes."""

    @abstractmethod
    def local_rank(self) -> int:
        """Rank of this process on its node."""

    @abstractmethod
    def node_rank(self) -> int:
        """Rank of this node."""

    def set_world_size(self, size: int) -> None:
        """Record the world size Lite computed; environments that know it already ignore this."""

    def set_global_rank(self, rank: int) -> None:
        """Record the global rank Lite computed; environments that know it already ignore this."""

    def process_counts(self) -> tuple[int, int] | None:
        """The processes per node and the number of nodes the launcher started, if it says.

        `LightningLite(devices=..., num_nodes=...)` left at their defaults take these, so a script
        that names no counts runs under any launcher. `None` (the default) where Lite starts the
        processes itself or the launcher does not tell.
        """
        return None

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise `ConfigurationError` when `devices`/`num_nodes` contradict this environment."""

    def teardown(self) -> None:
        """Undo environment variables this object exported."""
