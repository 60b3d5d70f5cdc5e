"""Processes started by IBM Spectrum LSF with `jsrun`."""

from __future__ import annotations

import os
import socket

from lite_core.environments._envvars import port_from_env_or_job
from lite_core.environments._launched import LaunchedEnvironment
from lite_core.errors import ConfigurationError


class LSFEnvironment(LaunchedEnvironment):
    """Reads the ranks `jsrun` exports and the hosts listed in LSF's rank file.

    The rank file (`LSB_DJOB_RANKFILE`) has one host per line; its first line is the launch (batch)
    host, which runs no workers, and the unique hosts after it are the compute nodes in order. It is
    read once, on first use. `MASTER_ADDR` and `MASTER_PORT` override the first compute host and the
    port derived from `LSB_JOBID`.
    """

    name = "lsf"
    _launcher = "LSF (jsrun)"
    _world_variable, _rank_variable, _local_rank_variable = (
        "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK")

    def __init__(self) -> None:
        self._hosts: list[str] | None = None

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR") or self.compute_hosts()[0]

    @property
    def main_port(self) -> int:
        return port_from_env_or_job("LSB_JOBID", self._launcher)

    @staticmethod
    def detect() -> bool:
        required = (
            "LSB_JOBID",
            "LSB_DJOB_RANKFILE",
            "JSM_NAMESPACE_LOCAL_RANK",
            "JSM_NAMESPACE_SIZE",
        )
        return all(name in os.environ for name in required)

    def node_rank(self) -> int:
        hosts = self.compute_hosts()
        hostname = socket.gethostname()
        for candidate in (hostname, hostname.split(".")[0]):
            for index, host in enumerate(hosts):
                if candidate in (host, host.split(".")[0]):
                    return index
        raise ConfigurationError(
            f"This host {hostname!r} is not among the compute hosts {hosts} of the LSF rank file: "
            f"start the script with jsrun inside the LSF job."
        )

    def compute_hosts(self) -> list[str]:
        """The unique compute hosts of the rank file, in order, without the launch host.

        Raises:
            ConfigurationError: The rank file is unset, unreadable or lists no compute host.
        """
        if self._hosts is None:
            path = os.environ.get("LSB_DJOB_RANKFILE", "")
            try:
                with open(path, encoding="utf-8") as file:
                    lines = [line.strip() for line in file if line.strip()]
            except OSError as error:
                raise ConfigurationError(
                    f"The LSF rank file LSB_DJOB_RANKFILE={path!r} cannot be read "
                    f"({error.strerror}): run the script through jsrun inside the LSF job."
                ) from None
            hosts = list(dict.fromkeys(lines[1:]))
            if not hosts:
                raise ConfigurationError(
                    f"The LSF rank file {path!r} lists no compute host after the launch host: "
                    f"run the script through jsrun on compute nodes of the LSF job."
                )
            self._hosts = hosts
        return self._hosts

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check that jsrun's world size equals `devices * num_nodes`.

        Raises:
            ConfigurationError: The world size disagrees with the Lite arguments.
        """
        self._require_world(num_devices, num_nodes, f"jsrun started {self.world_size()} processes",
                            "change devices/num_nodes or the jsrun resource set counts")
