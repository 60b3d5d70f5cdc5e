"""Two "nodes" on loopback, each its own `lite run` meeting at a c10d rendezvous, like two
machines running the same command: a plain 2-node job, a worker that dies once on node 2 under
`--max-restarts 1`, node 2's launcher killed for good under `--nnodes 1:2`, and node 2 started
while node 1 trains alone under `--nnodes 1:2 --max-restarts 0` (taken in without spending a
restart); and with `split_batches=True` and a checkpoint every step, node 2 lost in the middle of
an epoch, node 1 going on from the last step's sample; and the same under fsdp over a stream, with
two nodes that share no folder, the sharded checkpoint kept in a bucket only (moto's S3 server on
loopback), so the survivor reads back the lost node's shards from the store and the stream's
position. Each ends with the weights of one
uninterrupted process (1e-6), because `elastic_job.py` resumes from its checkpoint and keeps its
global batch at any world size."""

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

#: Short rendezvous timeouts, so that a lost node is given up on quickly.
RDZV_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5"
#: A hang guard for a killed launcher's worker to end: it ends within a second (its parent-death
#: signal, through the fork server's proxies when forked), but under CI's load (10 on 2 cores) one
#: took over 5 s.
WORKER_GONE = 60


def uninterrupted_weights(shuffle: bool = False, stream: bool = False) -> list[list[float]]:
    """elastic_job.py in one plain PyTorch process: batches of 8, in order (or shuffled, or from its stream)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    try:
        from elastic_job import reference_weights
    finally:
        sys.path.pop(0)
    return reference_weights(shuffle=shuffle, stream=stream)


def assert_uninterrupted(record: dict, shuffle: bool = False, stream: bool = False) -> None:
    for got, want in zip(record["weight"], uninterrupted_weights(shuffle, stream)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)


def node_options(port: int, node: int, nnodes: str, restarts: int, conf: str = RDZV_CONF) -> tuple[str, ...]:
    """The Python arguments of one node's `lite run` (one rank a node): node 0 hosts the rendezvous
    store (`is_host=1`), the others only join it."""
    return ("-m", "lite_core.cli", "run", "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "--rdzv-conf",
            f"{conf},is_host={int(node == 0)}", "--max-restarts", str(restarts))


def start_node(start_script, port: int, out: Path, how: str, node: int, nnodes: str = "2", restarts: int = 0,
               env: dict[str, str] | None = None):
    options = node_options(port, node, nnodes, restarts)
    # The script names no accelerator, like the torchrun tests' (tests/integration/elastic).
    return start_script("elastic_job.py", out, how, env={"LITE_ACCELERATOR": "cpu", **(env or {})}, python_args=options)


def start_nodes(start_script, port: int, out: Path, how: str, nnodes: str = "2", restarts: int = 0) -> list:
    return [start_node(start_script, port, out, how, node, nnodes, restarts) for node in (0, 1)]


def wait_until_waiting(out: Path, nodes: list) -> int:
    """The pid elastic_job.py's waiting rank wrote to OUT/waiting, once it is there."""
    deadline = time.monotonic() + 120
    while not (out / "waiting").exists():
        assert all(node.poll() is None for node in nodes) and time.monotonic() < deadline
        time.sleep(0.1)
    return int((out / "waiting").read_text())


def finish(node, timeout: float = 150) -> tuple[int, str]:
    out, err = node.communicate(timeout=timeout)
    return node.returncode, f"{out}\n{err}"


def records(out: Path) -> dict[int, dict]:
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_two_nodes_train_as_one_process(start_script, free_tcp_port, tmp_path):
    nodes = start_nodes(start_script, free_tcp_port(), tmp_path, "steady")
    for node in nodes:
        code, output = finish(node)
        assert code == 0, output
    done = records(tmp_path)
    assert sorted(done) == [0, 1] and all(r["world"] == 2 and r["restart"] == "0" for r in done.values())
    for record in done.values():
        assert_uninterrupted(record)


def test_a_worker_that_dies_on_node_2_restarts_every_worker(start_script, free_tcp_port, tmp_path):
    nodes = start_nodes(start_script, free_tcp_port(), tmp_path, "die-once", restarts=1)
    outputs = [finish(node) for node in nodes]
    for code, output in outputs:
        assert code == 0, output
    assert "lite run: local rank 0 failed with exit code 3; stopping every rank." in outputs[1][1]
    assert (tmp_path / "died").exists()
    done = records(tmp_path)
    assert sorted(done) == [0, 1] and all(r["world"] == 2 for r in done.values())
    # Node 2 restarted after its failure; node 1 either after its own rank failed or because
    # node 2 came back to the rendezvous (a membership restart, which the agent does not count).
    assert done[1]["restart"] == "1" and done[0]["restart"] in ("0", "1")
    for record in done.values():
        assert_uninterrupted(record)


def test_losing_node_2_for_good_goes_on_at_the_smaller_world_size(start_script, free_tcp_port, tmp_path, wait_gone):
    node0, node1 = start_nodes(start_script, free_tcp_port(), tmp_path, "wait-to-be-killed", nnodes="1:2", restarts=1)
    worker = wait_until_waiting(tmp_path, [node0, node1])
    os.kill(node1.pid, signal.SIGKILL)  # the launcher only: its worker must die with it
    node1.wait()
    assert wait_gone([worker], WORKER_GONE) == []
    code, output = finish(node0)
    assert code == 0, output
    done = records(tmp_path)
    assert sorted(done) == [0], output  # node 2's rank never finished
    assert done[0]["world"] == 1 and done[0]["restart"] == "1"
    assert_uninterrupted(done[0])


def test_a_node_lost_mid_epoch_resumes_at_the_next_sample_with_the_same_global_batch(
        start_script, free_tcp_port, tmp_path, wait_gone):
    # split_batches=True and a checkpoint after every step: node 1 alone finishes the interrupted
    # epoch from the last step's sample, with batches of 8 as the 2-node job had.
    how = "wait-to-be-killed+split"
    node0, node1 = start_nodes(start_script, free_tcp_port(), tmp_path, how, nnodes="1:2", restarts=1)
    worker = wait_until_waiting(tmp_path, [node0, node1])
    os.kill(node1.pid, signal.SIGKILL)
    node1.wait()
    assert wait_gone([worker], WORKER_GONE) == []
    code, output = finish(node0)
    assert code == 0, output
    done = records(tmp_path)
    assert sorted(done) == [0] and done[0]["world"] == 1 and done[0]["restart"] == "1", output
    assert_uninterrupted(done[0], shuffle=True)


def test_a_node_that_starts_later_is_taken_in_without_using_a_restart(start_script, free_tcp_port, tmp_path):
    # --max-restarts 0: the join must not need a restart from the budget for failures.
    port = free_tcp_port()
    node0 = start_node(start_script, port, tmp_path, "wait-for-a-node", 0, nnodes="1:2")
    wait_until_waiting(tmp_path, [node0])  # alone, one epoch done and checkpointed, waiting mid-epoch
    node1 = start_node(start_script, port, tmp_path, "wait-for-a-node", 1, nnodes="1:2")
    outputs = [finish(node) for node in (node0, node1)]
    for code, output in outputs:
        assert code == 0, output
    assert "lite run: a node joined the job; restarting every rank at the new world size." in outputs[0][1]
    assert not any("lite run: local rank" in out or "(restart " in out for _, out in outputs), outputs
    progress = (tmp_path / "progress.txt").read_text().splitlines()
    assert progress == ["epoch 0 world 1", "epoch 1 world 2", "epoch 2 world 2"], progress
    done = records(tmp_path)
    # Neither node used a restart: node 1's ranks were restarted for the membership change only.
    assert sorted(done) == [0, 1] and all(r["world"] == 2 and r["restart"] == "0" for r in done.values())
    for record in done.values():
        assert_uninterrupted(record)


@pytest.mark.timeout(400)  # a hang guard: about 30 s on an idle machine
def test_nodes_without_a_common_folder_lose_one_reading_a_stream_and_resume_from_the_bucket(
        start_script, free_tcp_port, tmp_path, wait_gone, s3_server, s3_bucket):
    # fsdp's sharded checkpoint after every step, in the bucket only: each node wrote its own shards
    # there, and node 1, alone, reads both of them back at world size 1, mid-epoch, and goes on
    # with the stream's next global batch.
    folders = [tmp_path / "node0", tmp_path / "node1"]
    env = {**s3_server.env, "LITE_STRATEGY": "fsdp", "ELASTIC_JOB_CHECKPOINT": f"{s3_bucket}/elastic/last"}
    port = free_tcp_port()
    nodes = []
    for node, folder in enumerate(folders):
        folder.mkdir()
        nodes.append(start_node(start_script, port, folder, "wait-to-be-killed+stream", node, "1:2", 1, env))
    worker = wait_until_waiting(folders[1], nodes)  # rank 1 runs on node 2 (agents rank by pid)
    os.kill(nodes[1].pid, signal.SIGKILL)
    nodes[1].wait()
    assert wait_gone([worker], WORKER_GONE) == []
    code, output = finish(nodes[0])
    assert code == 0, output
    done = records(folders[0])
    assert sorted(done) == [0] and done[0]["world"] == 1 and done[0]["restart"] == "1", output
    assert done[0]["resumed_step"] == 5, output  # after the 2-node job's last checkpoint: 4 + 1 steps
    assert_uninterrupted(done[0], stream=True)
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("*.distcp")), "a checkpoint went to a folder"
