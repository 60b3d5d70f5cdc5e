"""Two ranks for the GPU check's two-process cells, on a machine with 2 GPUs or with fewer.

With 2 or more GPUs a cell's `LightningLite(devices=2)` starts its second process as usual. With
fewer (one GPU, or the check's CPU run) the cell's script starts itself again as two one-process
"nodes" on loopback (`num_nodes=2`, `NODE_RANK`, the nodes Lite's local environment reads), which
share device 0. Each node has its own `NCCL_HOSTID`, so NCCL takes them for two hosts and connects
them over loopback sockets (`NCCL_SOCKET_IFNAME=lo` and `NCCL_IB_DISABLE=1` unless set) instead
of refusing a GPU that two of its ranks use, as torchft's examples put replica groups on shared
GPUs. Every collective then goes through host sockets: slower than two GPUs, but the same code
(NCCL, a rank per process, Lite's launch and mesh).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_NODE = "LITE_GPU_CHECK_NODE"


def share_a_device(device_type: str) -> bool:
    """Whether two ranks must share device 0 here (fewer than 2 GPUs, or a CPU run)."""
    import torch

    return device_type != "cuda" or torch.cuda.device_count() < 2


def is_node() -> bool:
    """Whether this process is one of the nodes `run_as_nodes` started."""
    return _NODE in os.environ


def two_ranks() -> dict[str, int]:
    """`LightningLite`'s arguments for two ranks in this process's layout."""
    return {"devices": 1, "num_nodes": 2} if is_node() else {"devices": 2}


def node_variables(name: str) -> dict[str, str]:
    """What makes NCCL take a process for a host of its own, called `name`, reached over loopback
    sockets: an InfiniBand or RoCE card the machine may have is left out (`NCCL_IB_DISABLE=1`
    unless set), so that the cell does not depend on its ports being up."""
    return {"NCCL_HOSTID": name, "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
            "NCCL_IB_DISABLE": os.environ.get("NCCL_IB_DISABLE", "1")}


def run_as_nodes(argv: list[str], timeout: float = 300) -> int:
    """Run `python argv` as node 0 and node 1 and wait for both: node 0 prints to this process's
    output, node 1's output is printed only if it fails. Returns 0 when both exit 0."""
    from lite_core.plugins import find_free_port

    port = str(find_free_port())
    procs = []
    with tempfile.TemporaryFile("w+") as second_output:
        for node in (0, 1):
            env = {**os.environ, _NODE: str(node), "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port, **node_variables(f"lite-gpu-check-node-{node}")}
            output = {"stdout": second_output, "stderr": subprocess.STDOUT} if node else {}
            procs.append(subprocess.Popen([sys.executable, *argv], env=env, text=True, **output))
        try:
            codes = [proc.wait(timeout=timeout) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        if codes[1]:
            second_output.seek(0)
            print(f"node 1 exited {codes[1]}:\n{second_output.read()[-4000:]}", flush=True)
    return next((code for code in codes if code), 0)
