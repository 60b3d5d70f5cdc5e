"""The lighthouse is the job's single point of failure: when it dies, the group ends in one sentence."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import free_port  # the repository's conftest.py

from lite_core import LightningLite
from lite_core.plugins import LiteError
from lite_torchft import DDPFTStrategy


@pytest.mark.timeout(90)
def test_a_dead_lighthouse_ends_the_group_with_one_sentence(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    port = free_port()
    command = Path(sys.executable).with_name("torchft_lighthouse")  # the command torchft's wheel installs
    server = subprocess.Popen([str(command), "--min_replicas", "1", "--bind", f"[::]:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{port}")

    def train(lite: LightningLite) -> None:
        net = torch.nn.Linear(1, 1)
        net, optimizer = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for step in range(3):
            if step == 1:
                server.kill()
                server.wait()
            lite.backward(net(torch.ones(1, 1)).sum())
            optimizer.step()

    lite = LightningLite(accelerator="cpu", strategy=DDPFTStrategy(ft_timeout=3, quorum_timeout=3, connect_timeout=2))
    try:
        with pytest.raises(LiteError, match="The torchft lighthouse stopped answering .*single point of failure"):
            lite.launch(train)
    finally:
        server.kill()
