"""Processes started by SLURM (`srun`, or `sbatch` scripts that call `srun`)."""

from __future__ import annotations

import os
import re

from lite_core.environments._envvars import counts_of, env_int, int_or_none, port_from_env_or_job
from lite_core.environments._launched import LaunchedEnvironment
from lite_core.errors import ConfigurationError

_INTERACTIVE_JOB_NAMES = ("bash", "interactive")
_MPIRUN_MARKERS = ("OMPI_COMM_WORLD_SIZE", "MPI_LOCALRANKID")  # Open MPI's, Hydra's mpirun


def parse_slurm_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed host list into host names, keeping the zero padding of ranges.

    For example `"node[01-02,07],gpu5"` becomes `["node01", "node02", "node07", "gpu5"]`.

    Raises:
        ConfigurationError: The brackets do not balance or a range is not numeric and ascending.
    """
    entries: list[str] = []
    depth = start = 0
    for i, char in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            break
        if char == "," and depth == 0:
            entries.append(hostlist[start:i])
            start = i + 1
    if depth != 0:
        raise _bad_hostlist(hostlist)
    entries.append(hostlist[start:])
    return [host for entry in entries if entry.strip() for host in _expand(entry.strip(), hostlist)]


def _expand(entry: str, hostlist: str) -> list[str]:
    """Expand one host pattern, which may hold several bracket groups."""
    match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", entry)
    if match is None:
        return [entry]
    prefix, ranges, rest = match.groups()
    values: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not (high.isdigit() and int(high) >= int(low))):
            raise _bad_hostlist(hostlist)
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1))
    return [prefix + value + tail for value in values for tail in _expand(rest, hostlist)]


def _bad_hostlist(hostlist: str) -> ConfigurationError:
    return ConfigurationError(
        f"SLURM host list {hostlist!r} cannot be parsed: export MASTER_ADDR to the host of node 0."
    )


class SLURMEnvironment(LaunchedEnvironment):
    """Reads the ranks SLURM assigns to each task started by `srun`.

    Interactive allocations (job name `bash` or `interactive`) are not detected, so that Lite can
    start its own processes inside them; nor are processes that `mpirun` started inside a job.
    `MASTER_ADDR` and `MASTER_PORT` override the first host of the node list and the port derived
    from `SLURM_JOB_ID`.
    """

    name = "slurm"
    _launcher = "SLURM (srun)"
    _world_variable, _rank_variable, _local_rank_variable = "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        nodelist = os.environ.get("SLURM_NODELIST", os.environ.get("SLURM_JOB_NODELIST"))
        hosts = parse_slurm_hostlist(nodelist) if nodelist else []
        if not hosts:
            raise ConfigurationError(
                "SLURM_NODELIST and SLURM_JOB_NODELIST are unset or empty: "
                "export MASTER_ADDR to the host of node 0."
            )
        return hosts[0]

    @property
    def main_port(self) -> int:
        return port_from_env_or_job("SLURM_JOB_ID", self._launcher)

    @staticmethod
    def detect() -> bool:
        # mpirun/mpiexec inside an allocation starts the ranks through its own daemons, whose
        # SLURM_* ranks describe the daemons; the MPI launcher's variables then win.
        started_by_mpirun = any(name in os.environ for name in _MPIRUN_MARKERS)
        return (
            "SLURM_NTASKS" in os.environ
            and os.environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_JOB_NAMES
            and not started_by_mpirun
        )

    def node_rank(self) -> int:
        return env_int("SLURM_NODEID", self._launcher)

    def process_counts(self) -> tuple[int, int] | None:
        per_node, nodes = int_or_none("SLURM_NTASKS_PER_NODE"), int_or_none("SLURM_NNODES")
        if per_node is not None:
            return counts_of(per_node, self.world_size())
        if nodes is not None and self.world_size() % nodes == 0:
            return self.world_size() // nodes, nodes
        return None

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check `--ntasks-per-node`, `--nodes` and `--ntasks` against `devices` and `num_nodes`.

        Raises:
            ConfigurationError: The allocation disagrees with the Lite arguments.
        """
        if "SLURM_NTASKS_PER_NODE" in os.environ:
            per_node = env_int("SLURM_NTASKS_PER_NODE", self._launcher)
            self._require_count(per_node, num_devices, "devices", f"SLURM runs {per_node} tasks per node",
                                f"sbatch --ntasks-per-node={num_devices}")
        if "SLURM_NNODES" in os.environ:
            nodes = env_int("SLURM_NNODES", self._launcher)
            self._require_count(nodes, num_nodes, "num_nodes", f"SLURM allocated {nodes} nodes",
                                f"sbatch --nodes={num_nodes}")
        self._require_world(num_devices, num_nodes, f"SLURM started {self.world_size()} tasks",
                            f"sbatch --ntasks-per-node={num_devices} --nodes={num_nodes}")
