"""Processes started by `mpirun`/`mpiexec` (Open MPI, MPICH, Intel MPI), read without mpi4py."""

from __future__ import annotations

import os

from lite_core.environments._envvars import counts_of, env_int
from lite_core.environments._launched import LaunchedEnvironment
from lite_core.errors import ConfigurationError

#: Port used when `MASTER_PORT` is unset. MPI launchers export no portable job id to derive a
#: port from, so two MPI jobs sharing a node 0 must set different `MASTER_PORT`s.
DEFAULT_MPI_PORT = 29510

# (global rank, world size, local rank, local size) per MPI implementation family.
_OPEN_MPI = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
_HYDRA = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")  # MPICH, Intel MPI


class MPIEnvironment(LaunchedEnvironment):
    """Reads the ranks that Open MPI or MPICH/Intel MPI (Hydra) export to each process.

    Open MPI sets `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`; Hydra sets `PMI_RANK`,
    `PMI_SIZE`, `MPI_LOCALRANKID` and `MPI_LOCALNRANKS`.

    The node rank is `global rank // local size`, which assumes that ranks fill one node before the
    next (the default `--map-by slot`/`-ppn` placement) and the same number of processes per node.
    `MASTER_ADDR` defaults to loopback only when the whole job is on one node; `MASTER_PORT`
    defaults to `DEFAULT_MPI_PORT`.
    """

    name = "mpi"
    _launcher = "mpirun"

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        if self.world_size() == self._local_size():
            return "127.0.0.1"
        raise ConfigurationError(
            "MASTER_ADDR is not set for an MPI job on several nodes: export it to the host of "
            "rank 0 for every process, e.g. `mpirun -x MASTER_ADDR=<node 0 host>` "
            "(Open MPI) or `mpiexec -genv MASTER_ADDR <node 0 host>` (MPICH)."
        )

    @property
    def main_port(self) -> int:
        return env_int("MASTER_PORT", self._launcher, default=DEFAULT_MPI_PORT)

    @staticmethod
    def detect() -> bool:
        return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ

    @staticmethod
    def _names() -> tuple[str, str, str, str]:
        return _OPEN_MPI if "OMPI_COMM_WORLD_SIZE" in os.environ else _HYDRA

    def world_size(self) -> int:
        return env_int(self._names()[1], self._launcher)

    def global_rank(self) -> int:
        return env_int(self._names()[0], self._launcher)

    def local_rank(self) -> int:
        return env_int(self._names()[2], self._launcher)

    def _local_size(self) -> int:
        return env_int(self._names()[3], self._launcher)

    def process_counts(self) -> tuple[int, int] | None:
        return counts_of(self._local_size(), self.world_size())

    def node_rank(self) -> int:
        # OMPI_COMM_WORLD_NODE_RANK is not a node index (it counts processes on the node across
        # jobs), so the node rank is computed from the block placement of ranks instead.
        rank, local_rank, local_size = self.global_rank(), self.local_rank(), self._local_size()
        if local_size < 1 or rank % local_size != local_rank:
            raise ConfigurationError(
                f"MPI rank {rank} has local rank {local_rank} of {local_size}, so ranks are not "
                f"placed node by node: start the job with `mpirun --map-by slot` (Open MPI) or "
                f"`mpiexec -ppn {local_size}` (MPICH) and the same number of processes per node."
            )
        return rank // local_size

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check the processes per node and the world size against `devices` and `num_nodes`.

        Raises:
            ConfigurationError: The MPI launch disagrees with the Lite arguments.
        """
        local_size, world = self._local_size(), self.world_size()
        self._require_count(local_size, num_devices, "devices", f"mpirun started {local_size} processes per node",
                            f"`mpirun --npernode {num_devices}`")
        self._require_world(num_devices, num_nodes, f"mpirun started {world} processes",
                            f"num_nodes={max(world // max(num_devices, 1), 1)} or `mpirun -np {num_devices * num_nodes}`")
