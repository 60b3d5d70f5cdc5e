"""The environment of processes that Lite starts itself (or that the user starts by hand)."""

from __future__ import annotations

import os
import random
import socket

from lite_core.environments._envvars import counts_of, env_int, int_or_none
from lite_core.environments.environment import ClusterEnvironment
from lite_core.errors import ConfigurationError


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a job's store (`MASTER_PORT`), drawn at random below the
    kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`).

    The kernel gives the ports of outgoing connections and of `bind(0)` from that range, so a port
    found with `bind(0)` and closed again may be taken by any connection before the store binds it
    ("MASTER_PORT=... is already in use" on a busy machine). Below the range the kernel hands out
    nothing by itself. Where no port there is free, the kernel chooses one.
    """
    low, high = _below_ephemeral_range()
    for port in random.sample(range(low, high), k=min(_TRIES, high - low)):
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


#: Ports `find_free_port` tries below the ephemeral range before it lets the kernel choose.
_TRIES = 200


def _below_ephemeral_range() -> tuple[int, int]:
    """Ports [low, high) below the kernel's ephemeral range (IANA's, from 49152, where the kernel
    does not say), above the well-known and most registered service ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            first_ephemeral = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 49152
    return (10000 if first_ephemeral > 11000 else 1024), first_ephemeral


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _check_port(raw: str | None) -> None:
    if raw is None or (raw.strip().isdigit() and 0 < int(raw) < 65536):
        return
    raise ConfigurationError(
        f"MASTER_PORT={raw!r} is not a port number: set it to a free port from 1024 to 65535, or unset it to let"
        " Lite choose one."
    )


class LocalEnvironment(ClusterEnvironment):
    """Processes on one machine started by Lite's launchers, or several nodes set up by hand.

    Reads `MASTER_ADDR` (default loopback), `MASTER_PORT` (default: a free port, exported so that
    the processes Lite starts share it), `NODE_RANK` and `LOCAL_RANK`. A launcher that started the
    processes itself (`lite run`) also exports `LOCAL_WORLD_SIZE` and `WORLD_SIZE`, which must
    agree with `devices` and `num_nodes`.
    """

    name = "local"

    def __init__(self) -> None:
        self._world_size = 1
        self._global_rank = 0

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(find_free_port())
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = size

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))

    def process_counts(self) -> tuple[int, int] | None:
        per_node = int_or_none("LOCAL_WORLD_SIZE") if self.creates_processes_externally else None
        if per_node is None:
            return None
        return counts_of(per_node, int_or_none("WORLD_SIZE") or per_node)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check the process counts an external launcher exported against `devices` and `num_nodes`.

        Raises:
            ConfigurationError: The processes started per node, or in total, disagree.
        """
        if num_devices * num_nodes > 1:
            _check_port(os.environ.get("MASTER_PORT"))
        if not self.creates_processes_externally or "LOCAL_WORLD_SIZE" not in os.environ:
            return
        per_node = env_int("LOCAL_WORLD_SIZE", "lite run")
        world = env_int("WORLD_SIZE", "lite run", default=per_node * num_nodes)
        if per_node != num_devices or world != num_devices * num_nodes:
            raise ConfigurationError(
                f"The launcher started {per_node} process(es) per node and {world} in total but"
                f" LightningLite(devices={num_devices}, num_nodes={num_nodes}) expects {num_devices} and"
                f" {num_devices * num_nodes}: make them agree, e.g. `lite run --devices {num_devices}"
                f" --num-nodes {num_nodes}`, or leave devices and num_nodes out of the code."
            )
