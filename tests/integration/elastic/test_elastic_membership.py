"""`torchrun --nnodes 1:2`: when one of two nodes goes for good (its launcher is killed with its
workers), the other goes on alone after re-rendezvous, and a job that resumes from its checkpoint
and sizes its per-rank batch from `world_size` ends equal to the uninterrupted one-process run."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

SCRIPTS = Path(__file__).parents[2] / "scripts"
JOB = str(SCRIPTS / "elastic_job.py")
#: Short rendezvous and dead-node timeouts: a lost node is noticed after about 10 seconds
#: (keep_alive_interval x keep_alive_max_attempt; at 1 s x 2 a loaded machine once split a live
#: two-node job in two, a node busy stopping its rank missing its heartbeats) and a round closes 10
#: seconds after it can start (a node that comes later starts a round of its own under torchrun, so
#: both must be in the first: under CI's load one launcher can take several seconds longer than the
#: other to get there).
RDZV_CONF = "join_timeout=60,last_call_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=5"


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    """`pid`'s children, grandchildren, ... (torch's agent starts its workers in sessions of their own)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def kill_node(pid: int) -> None:
    """SIGKILL a launcher and every process under it, as when its machine goes away."""
    for victim in [pid, *descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_remaining_node_goes_on_at_the_smaller_world_size(start_script, free_tcp_port, tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        from elastic_job import reference_weights
    finally:
        sys.path.pop(0)
    port = free_tcp_port()

    def torchrun(is_host: bool) -> tuple[str, ...]:
        return ("-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts",
                "2", "--monitor-interval", "0.5", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-conf", f"{RDZV_CONF},is_host={int(is_host)}")

    # Fresh interpreters (not the fork server's): kill_node finds a node's processes by walking
    # /proc's parent links, and a forked program's parent there is the fork server's proxy.
    env = {"LITE_ACCELERATOR": "cpu", "LITE_TEST_FORKSERVER": "0"}
    progress = tmp_path / "progress.txt"
    # Both at once, as two machines would start: node 1 hosts the rendezvous store, node 2 (told it
    # is no host, so it never opens a store of its own on the shared port) connects to it.
    node1 = start_script(JOB, tmp_path, "steady", "0.4", env=env, python_args=torchrun(is_host=True))
    node2 = start_script(JOB, tmp_path, "steady", "0.4", env=env, python_args=torchrun(is_host=False))
    wait_for(lambda: progress.exists() and "world 2" in progress.read_text(), 90, "an epoch at world size 2")

    kill_node(node2.pid)  # node 2's launcher and its worker, for good
    node2.wait()
    stdout, stderr = node1.communicate(timeout=120)
    assert node1.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"

    epochs = progress.read_text().splitlines()
    assert epochs[-1] == "epoch 2 world 1", epochs  # the job ended on node 1 alone
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["world"] == 1
    for got, want in zip(record["weight"], reference_weights()):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)
