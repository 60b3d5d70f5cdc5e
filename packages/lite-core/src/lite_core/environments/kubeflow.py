"""Processes started by a Kubeflow `PyTorchJob` (one process per pod)."""

from __future__ import annotations

import os

from lite_core.environments._launched import LaunchedEnvironment
from lite_core.errors import ConfigurationError


class KubeflowEnvironment(LaunchedEnvironment):
    """Reads what the Kubeflow training operator exports to each pod of a `PyTorchJob`.

    Each pod runs one process, so the pod's `RANK` is both its global rank and its node rank, and
    its local rank is 0. Pods whose command is `torchrun` are handled by `TorchElasticEnvironment`.
    """

    name = "kubeflow"
    _launcher = "the Kubeflow training operator"

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @staticmethod
    def detect() -> bool:
        required = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        return all(name in os.environ for name in required) and not under_torchrun

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()

    def process_counts(self) -> tuple[int, int] | None:
        return 1, self.world_size()  # one process per pod

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check that Lite asks for one device per pod and one node per pod.

        Raises:
            ConfigurationError: `devices` is not 1, or `num_nodes` is not the number of pods.
        """
        if num_devices != 1:
            raise ConfigurationError(
                f"A Kubeflow PyTorchJob runs one process per pod but "
                f"LightningLite(devices={num_devices}) asks for {num_devices}: set devices=1 and "
                f"scale with the job's replicas, or launch torchrun inside each pod."
            )
        world = self.world_size()
        self._require_count(world, num_nodes, "num_nodes", f"The Kubeflow PyTorchJob has {world} pods")
