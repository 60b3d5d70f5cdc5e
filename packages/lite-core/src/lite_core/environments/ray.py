"""Processes started by Ray Train (`TorchTrainer`), which also creates their process group."""

from __future__ import annotations

import os
import sys

from lite_core.environments._envvars import counts_of, env_int
from lite_core.environments._launched import LaunchedEnvironment
from lite_core.errors import ConfigurationError

#: What Ray Train's torch backend exports to each worker (`ray/train/torch/config.py`).
_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


class RayTrainEnvironment(LaunchedEnvironment):
    """Reads what Ray Train exports to each worker of a `TorchTrainer`.

    Ray sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `NODE_RANK` and `MASTER_ADDR`
    and creates the process group before the train function runs; Lite reuses that group. The
    worker has Ray imported, which tells it apart from a process that merely has those variables
    (the scheduler's variables around Ray, SLURM's or Kubernetes', describe Ray's own processes).

    The rank and world size are those of the process group Ray created, once it exists: Lite works
    in that group. They equal `RANK` and `WORLD_SIZE` under Ray's `TorchConfig`; under a backend
    with replica groups (`TorchftConfig`), `RANK` and `WORLD_SIZE` count the whole job while the
    group holds one replica group.
    """

    name = "ray"
    _launcher = "Ray Train"

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @staticmethod
    def detect() -> bool:
        return "ray" in sys.modules and all(name in os.environ for name in _VARIABLES)

    def world_size(self) -> int:
        group = _rays_process_group()
        return group[1] if group is not None else super().world_size()

    def global_rank(self) -> int:
        group = _rays_process_group()
        return group[0] if group is not None else super().global_rank()

    def node_rank(self) -> int:
        return env_int("NODE_RANK", self._launcher)

    def process_counts(self) -> tuple[int, int] | None:
        return counts_of(env_int("LOCAL_WORLD_SIZE", self._launcher), self.world_size())

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check Ray's worker counts against `devices` and `num_nodes`.

        Raises:
            ConfigurationError: The workers per node or in total disagree.
        """
        per_node, world = env_int("LOCAL_WORLD_SIZE", self._launcher), self.world_size()
        if per_node != num_devices or world != num_devices * num_nodes:
            raise ConfigurationError(
                f"Ray Train started {per_node} worker(s) on this node and {world} in total but"
                f" LightningLite(devices={num_devices}, num_nodes={num_nodes}) expects {num_devices} and"
                f" {num_devices * num_nodes}: leave devices and num_nodes out of LightningLite(...) to take"
                " Ray's counts, or change ScalingConfig(num_workers=...)."
            )


def _rays_process_group() -> tuple[int, int] | None:
    """This worker's rank and the world size of the process group Ray created, if it exists."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()
