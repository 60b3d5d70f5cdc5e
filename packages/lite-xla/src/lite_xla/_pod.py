"""The hosts of a TPU pod, read without starting the XLA runtime.

Each host of a pod runs the same script; the TPU runtime (not `MASTER_ADDR`) joins them. Its
topology comes from the TPU environment variables when they are set (`TPU_WORKER_HOSTNAMES`,
`TPU_WORKER_ID`, as torch-xla reads them), else from torch-xla, which asks the TPU VM's metadata.
"""

from __future__ import annotations

import os

from lite_core.plugins import ConfigurationError


def check_hosts(num_nodes: int) -> None:
    """Refuse `num_nodes` unless this is a TPU pod of exactly that many hosts."""
    if os.environ.get("PJRT_DEVICE", "TPU").upper() != "TPU":
        raise ConfigurationError(
            f"num_nodes={num_nodes} runs XLA on the hosts of a TPU pod, but PJRT_DEVICE="
            f"{os.environ['PJRT_DEVICE']} runs on this host only: pass num_nodes=1."
        )
    hosts = host_count()
    if hosts != num_nodes:
        raise ConfigurationError(
            f"num_nodes={num_nodes} but this TPU pod has {hosts} host(s): pass num_nodes={hosts}, and run"
            " the script on every host of the pod."
        )


def host_count() -> int:
    """How many hosts the TPU pod has (1 on a single TPU VM)."""
    names = os.environ.get("TPU_WORKER_HOSTNAMES")
    if names:
        return len(names.split(","))
    return _ask_torch_xla("num_tpu_workers")


def host_index() -> int:
    """This host's index in the TPU pod."""
    for name in ("CLOUD_TPU_TASK_ID", "TPU_WORKER_ID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return _ask_torch_xla("worker_id")


def _ask_torch_xla(what: str) -> int:
    try:
        from torch_xla._internal import tpu

        return int(getattr(tpu, what)())
    except Exception as err:  # no TPU metadata here: not a TPU VM
        raise ConfigurationError(
            f"The TPU pod's hosts could not be read ({type(err).__name__}: {err}): run on the hosts of a"
            " TPU pod, or set TPU_WORKER_HOSTNAMES and TPU_WORKER_ID on each host."
        ) from err
