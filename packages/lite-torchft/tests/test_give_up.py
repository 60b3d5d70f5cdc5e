"""A replica group whose steps keep failing to commit gives up after `max_commit_failures`
consecutive failures, instead of retrying for ever (the README's "A group keeps failing")."""

from __future__ import annotations

import pytest
import torch

from lite_core import LightningLite
from lite_torchft import DDPFTStrategy


@pytest.mark.timeout(90)
def test_a_group_whose_steps_keep_failing_gives_up_after_max_commit_failures(
        lighthouse: str, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    decided: list[int] = []  # steps whose optimizer.step() returned (committed or not)

    def train(lite: LightningLite) -> torch.Tensor:
        net = torch.nn.Linear(1, 1)
        net, optimizer = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for step in range(10):
            lite.backward(net(torch.ones(1, 1)).sum())
            lite.strategy.manager.report_error(RuntimeError("a planted failure of this step"))  # as a dead peer's all-reduce would
            optimizer.step()
            decided.append(step)
        return net.weight.detach().clone()

    strategy = DDPFTStrategy(max_commit_failures=2, ft_timeout=3, quorum_timeout=10, connect_timeout=5)
    with pytest.raises(RuntimeError, match="should_commit failed 3 times consecutively, exceeding max_retries=2"):
        LightningLite(accelerator="cpu", strategy=strategy).launch(train)
    assert decided == [0, 1]  # two failed commits are retried; the third ends the group
