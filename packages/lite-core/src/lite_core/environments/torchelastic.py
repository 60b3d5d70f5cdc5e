"""Processes started by `torchrun` (TorchElastic)."""

from __future__ import annotations

import os

from lite_core.environ import LAUNCHER_PID_VARIABLE
from lite_core.environments._envvars import counts_of, env_int, int_or_none
from lite_core.environments._launched import LaunchedEnvironment
from lite_core.errors import ConfigurationError


class TorchElasticEnvironment(LaunchedEnvironment):
    """Reads what `torchrun` exports to each worker process.

    torchrun sets `TORCHELASTIC_RUN_ID`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
    `GROUP_RANK` (the node rank), `MASTER_ADDR` and `MASTER_PORT`.
    """

    name = "torchelastic"
    _launcher = "torchrun"

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" not in os.environ:
            raise ConfigurationError(
                "MASTER_ADDR is not set although the job looks like it runs under torchrun: "
                "start the script through torchrun or export MASTER_ADDR."
            )
        return os.environ["MASTER_ADDR"]

    @staticmethod
    def detect() -> bool:
        required = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        return all(name in os.environ for name in required)

    def node_rank(self) -> int:
        return env_int("GROUP_RANK", self._launcher, default=0)

    def process_counts(self) -> tuple[int, int] | None:
        per_node = int_or_none("LOCAL_WORLD_SIZE")
        return None if per_node is None else counts_of(per_node, self.world_size())

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check that torchrun's process counts match `devices` and `num_nodes`.

        Raises:
            ConfigurationError: The processes per node or the world size disagree.
        """
        launcher, per_node_flag, nodes_flag = _launcher_words()
        if "LOCAL_WORLD_SIZE" in os.environ:
            per_node = env_int("LOCAL_WORLD_SIZE", self._launcher)
            self._require_count(per_node, num_devices, "devices", f"{launcher} started {per_node} processes per node",
                                f"{launcher} {per_node_flag}={num_devices}")
        world = self.world_size()
        self._require_world(num_devices, num_nodes, f"{launcher} started {world} processes in total",
                            f"num_nodes={max(world // max(num_devices, 1), 1)}, {launcher} {nodes_flag}={num_nodes},"
                            f" or leave devices and num_nodes out of LightningLite(...) to take {launcher}'s counts")

def _launcher_words() -> tuple[str, str, str]:
    """(the launcher, its processes-per-node flag, its node-count flag) as the user typed them:
    `lite run` (which marks its ranks) or torchrun."""
    if LAUNCHER_PID_VARIABLE in os.environ:
        return "lite run", "--devices", "--num-nodes"
    return "torchrun", "--nproc-per-node", "--nnodes"
