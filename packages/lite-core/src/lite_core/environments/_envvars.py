"""Small readers for the environment variables that schedulers and launchers export."""

from __future__ import annotations

import os
import re

from lite_core.errors import ConfigurationError

#: Ports derived from a job id fall in [JOB_PORT_BASE, JOB_PORT_BASE + JOB_PORT_SPAN).
JOB_PORT_BASE = 15000
JOB_PORT_SPAN = 20000


def counts_of(per_node: int, world: int) -> tuple[int, int] | None:
    """`(per_node, nodes)` for `world` processes placed `per_node` to a node, or `None` when they
    do not divide evenly (then the counts cannot be one `devices` and one `num_nodes`)."""
    if per_node < 1 or world < per_node or world % per_node:
        return None
    return per_node, world // per_node


def int_or_none(name: str) -> int | None:
    """`name` as an integer, or `None` when it is unset or not a plain integer (`2(x3)`)."""
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else None


def env_int(name: str, launcher: str, default: int | None = None) -> int:
    """Read `name` as an integer; `launcher` names who should have set it, for the error message.

    Raises:
        ConfigurationError: The variable is missing (and has no default) or is not an integer.
    """
    value = os.environ.get(name)
    if value is None:
        if default is not None:
            return default
        raise ConfigurationError(
            f"{name} is not set although the job looks like it runs under {launcher}: "
            f"start the script through {launcher} or export {name}."
        )
    try:
        return int(value.strip())
    except ValueError:
        raise ConfigurationError(
            f"{name}={value!r} is not an integer: fix or unset {name} before starting the job."
        ) from None


def port_from_env_or_job(job_id_var: str, launcher: str) -> int:
    """Return `MASTER_PORT` if set, else a port derived from the job id in `job_id_var`.

    Every process of a job sees the same job id, so every node computes the same port without
    talking to the others, and two jobs on the same node rarely pick the same one.
    """
    if "MASTER_PORT" in os.environ:
        return env_int("MASTER_PORT", launcher)
    job_id = os.environ.get(job_id_var, "")
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        raise ConfigurationError(
            f"{job_id_var}={job_id!r} holds no numeric job id to derive a port from: "
            f"export MASTER_PORT to a free port that every node of the job uses."
        )
    return JOB_PORT_BASE + int(digits) % JOB_PORT_SPAN
