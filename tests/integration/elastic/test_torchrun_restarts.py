"""Plain `torchrun --max-restarts 1` restarts a Lite job whose rank 1 dies once, and the job ends as
if nothing had happened: the restarted workers build their process group on a store prefix of
their own attempt, so they never read the dead attempt's keys from the agent's store (without
the prefix they fail with "Gloo connectFullMesh failed ... Connection refused")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCRIPTS = Path(__file__).parents[2] / "scripts"
JOB = str(SCRIPTS / "elastic_job.py")
#: Short polling and rendezvous timeouts: on loopback a round takes well under a second.
TORCHRUN = ["-m", "torch.distributed.run", "--max-restarts", "1", "--monitor-interval", "0.5",
            "--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=60,last_call_timeout=1"]


def reference_weights() -> list[list[float]]:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from elastic_job import reference_weights
    finally:
        sys.path.pop(0)
    return reference_weights()


def assert_finished_like_an_uninterrupted_run(out_dir: Path, ranks: int = 2) -> None:
    assert (out_dir / "died").exists()  # rank 1 did die in the first attempt
    expected = reference_weights()
    for rank in range(ranks):
        record = json.loads((out_dir / f"rank{rank}.json").read_text())
        for got, want in zip(record["weight"], expected):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)


def test_one_node_of_two_processes_restarts(run_script, free_tcp_port, tmp_path, output_of):
    proc = run_script(command=[sys.executable, *TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2",
                               "--rdzv-endpoint", f"127.0.0.1:{free_tcp_port()}", JOB, str(tmp_path), "die-once"],
                      env={"LITE_ACCELERATOR": "cpu"}, timeout=120)
    assert proc.returncode == 0, output_of(proc)
    assert_finished_like_an_uninterrupted_run(tmp_path)


def test_two_nodes_restart(start_script, free_tcp_port, tmp_path):
    torchrun = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_tcp_port()}"]
    env = {"LITE_ACCELERATOR": "cpu"}  # the script names no counts: torchrun's are taken
    nodes = [start_script(JOB, tmp_path, "die-once", env=env, python_args=tuple(torchrun)) for _ in range(2)]
    for node in nodes:
        stdout, stderr = node.communicate(timeout=120)
        assert node.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert_finished_like_an_uninterrupted_run(tmp_path)
