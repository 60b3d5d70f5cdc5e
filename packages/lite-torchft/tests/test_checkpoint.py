"""`save` under `ddp_ft` holds the Manager's state and the loader positions; `load` puts them back,
so a whole-job restart resumes at the saved step and sample (one group, in this process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_torchft import DDPFTStrategy


@pytest.mark.timeout(90)
def test_a_checkpoint_resumes_the_step_and_the_loader_position(lighthouse: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    path = str(tmp_path / "ckpt.pt")

    def train(lite: LightningLite) -> tuple[list[int], int, list[int]]:
        net = torch.nn.Linear(1, 1)
        net, optimizer = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = lite.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8.0).unsqueeze(1)), batch_size=1))
        seen, batches = [], iter(loader)
        for _ in range(3):
            (x,) = next(batches)
            seen.append(int(x))
            lite.backward(net(x).sum())
            optimizer.step()
            optimizer.zero_grad()
            if len(seen) == 2:
                lite.save({"model": net, "optimizer": optimizer}, path)  # the strategy adds the loader positions
        lite.load(path, {"model": net, "optimizer": optimizer})
        resumed_step = lite.strategy.step
        return seen, resumed_step, [int(next(iter(loader))[0]) for _ in range(1)]

    strategy = DDPFTStrategy(ft_timeout=5)
    try:
        seen, resumed_step, after = LightningLite(accelerator="cpu", strategy=strategy).launch(train)
    finally:
        # In one process Lite keeps the environment until exit (a second run() reuses it); here the
        # Manager would go on heartbeating to this test's lighthouse, gone, in every later test's log.
        strategy.teardown()
    assert seen == [0, 1, 2]
    assert resumed_step == 2  # the Manager's step as saved, not 3
    assert after == [2]  # the loader resumes at the first sample after the saved step
    saved = torch.load(path, weights_only=True)
    assert saved["_torchft_manager"] == {"step": 2, "batches_committed": 2}
