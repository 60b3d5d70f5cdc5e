"""The torchft variables a replica group reads, checked once with errors that name the fix."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

from lite_core.plugins import ConfigurationError

_NAMES = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE")


@dataclass(frozen=True)
class ReplicaGroupVariables:
    """Which replica group this Lite job is and where the lighthouse listens."""

    group_id: int
    num_groups: int
    lighthouse: str


def read_variables() -> ReplicaGroupVariables:
    """Read `REPLICA_GROUP_ID`, `NUM_REPLICA_GROUPS` and `TORCHFT_LIGHTHOUSE`, or raise.

    Under Ray Train's `TorchftConfig`, which sets only `TORCHFT_LIGHTHOUSE`, the group's id and
    count come from Ray (see `_ray_train_groups`).
    """
    if not (os.environ.get("REPLICA_GROUP_ID") or os.environ.get("NUM_REPLICA_GROUPS")):
        groups = _ray_train_groups()
        if groups is not None and os.environ.get("TORCHFT_LIGHTHOUSE"):
            return ReplicaGroupVariables(*groups, os.environ["TORCHFT_LIGHTHOUSE"])
    missing = [name for name in _NAMES if not os.environ.get(name)]
    if missing:
        raise ConfigurationError(
            f"strategy='ddp_ft' needs {', '.join(missing)} set: start each replica group with REPLICA_GROUP_ID=<i>"
            " NUM_REPLICA_GROUPS=<n> TORCHFT_LIGHTHOUSE=http://<host>:<port> (or use"
            " `lite run --replica-groups N`, which sets them and starts the lighthouse)."
        )
    group_id, num_groups = _integer("REPLICA_GROUP_ID"), _integer("NUM_REPLICA_GROUPS")
    if not 0 <= group_id < num_groups:
        raise ConfigurationError(
            f"REPLICA_GROUP_ID={group_id} is outside 0..{num_groups - 1} (NUM_REPLICA_GROUPS={num_groups}):"
            " give each group a distinct id below NUM_REPLICA_GROUPS."
        )
    return ReplicaGroupVariables(group_id, num_groups, os.environ["TORCHFT_LIGHTHOUSE"])


def _ray_train_groups() -> tuple[int, int] | None:
    """The replica group id and count of a Ray Train worker whose process group holds it alone.

    Ray 2.60's `TorchftConfig` makes each worker its own replica group, with a process group of
    world size 1, and exports no group variables: the group is the worker's rank in the job and
    the groups are the job's workers (as Ray's own torchft example takes them). `None` outside a
    Ray Train worker, or where Ray's process group holds more than this worker.
    """
    if "ray" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != 1:
        return None
    import ray.train

    try:
        context = ray.train.get_context()
    except RuntimeError:  # ray imported, but this is no Ray Train worker
        return None
    return context.get_world_rank(), context.get_world_size()


def _integer(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"{name}={value!r} is not an integer: set it to a whole number.") from None


def check_lighthouse(address: str, timeout: float) -> None:
    """Raise a `ConfigurationError` if nothing accepts connections at the lighthouse `address`."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    host, port = parts.hostname, parts.port
    if host is None or port is None:
        raise ConfigurationError(
            f"TORCHFT_LIGHTHOUSE={address!r} is not an address: set it to http://<host>:<port>."
        )
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        raise ConfigurationError(
            f"No torchft lighthouse answers at TORCHFT_LIGHTHOUSE={address} ({err.strerror or err}): start one"
            " with `torchft_lighthouse --min_replicas 1 --bind [::]:<port>` or fix the address."
        ) from None
