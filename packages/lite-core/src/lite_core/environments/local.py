"""The environment of processes that Lite starts itself (or that the user starts by hand)."""

from __future__ import annotations

import os
import socket

from lite_core.environments.environment import ClusterEnvironment


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalEnvironment(ClusterEnvironment):
    """Processes on one machine started by Lite's launchers, or several nodes set up by hand.

    Reads `MASTER_ADDR` (default loopback), `MASTER_PORT` (default: a free port, exported so that
    the processes Lite starts share it), `NODE_RANK` and `LOCAL_RANK`.
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
