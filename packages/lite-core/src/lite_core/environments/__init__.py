"""Cluster environments: how Lite learns ranks and the main address from whoever started it."""

from __future__ import annotations

from lite_core.environments.environment import ClusterEnvironment
from lite_core.environments.kubeflow import KubeflowEnvironment
from lite_core.environments.local import LocalEnvironment
from lite_core.environments.lsf import LSFEnvironment
from lite_core.environments.mpi import MPIEnvironment
from lite_core.environments.ray import RayTrainEnvironment
from lite_core.environments.slurm import SLURMEnvironment
from lite_core.environments.torchelastic import TorchElasticEnvironment

#: Environments in the order `detect_environment` tries them; the first whose `detect()` is true
#: wins. Launchers come before schedulers (torchrun inside a SLURM job is torchrun, and so is a
#: Ray Train worker on a SLURM or Kubernetes cluster), and `LocalEnvironment`, which always
#: detects, comes last.
ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    RayTrainEnvironment,
    SLURMEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    KubeflowEnvironment,
    LocalEnvironment,
)


def detect_environment() -> ClusterEnvironment:
    """Return an instance of the first environment in `ENVIRONMENTS` that detects itself."""
    for environment_cls in ENVIRONMENTS:
        if environment_cls.detect():
            return environment_cls()
    return LocalEnvironment()


__all__ = [
    "ENVIRONMENTS",
    "ClusterEnvironment",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "RayTrainEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "detect_environment",
]
