"""The torchft variables a replica group reads, checked once with errors that name the fix."""

from __future__ import annotations

import os
import socket
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
    """Read `REPLICA_GROUP_ID`, `NUM_REPLICA_GROUPS` and `TORCHFT_LIGHTHOUSE`, or raise."""
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
