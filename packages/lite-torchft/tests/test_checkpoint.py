"""`save` under `ddp_ft` holds the Manager's state and the loader positions; `load` puts them back,
so a whole-job restart resumes at the saved step and sample (one group, in this process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import free_port, script_env  # the repository's conftest.py
from lite_core import LightningLite
from lite_torchft import DDPFTStrategy

SCRIPTS = Path(__file__).parent / "scripts"


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


def _job(lighthouse: str, *args: str) -> list[int]:
    """One job of scripts/resume_loader.py (a fresh process, as after a preemption)."""
    env = script_env(REPLICA_GROUP_ID="0", NUM_REPLICA_GROUPS="1", TORCHFT_LIGHTHOUSE=lighthouse,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "resume_loader.py"), *args], env=env, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "starts again from its first sample" not in proc.stderr, proc.stderr  # the position was kept
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("SEEN ")]
    return json.loads(line[len("SEEN "):])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "shuffle"), [("ddp_ft", "default"), ("diloco", "generator"), ("ddp_ft", "stream")])
def test_the_set_up_loader_in_the_saved_state_resumes_at_the_next_sample(lighthouse: str, tmp_path: Path,
                                                                        strategy: str, shuffle: str) -> None:
    """docs/preemption.md's loop puts `"loader": loader` in the state: the position is applied once
    (the strategy's stream and the loader's sampler both skipped it, landing on epoch 1's first batch).
    A stream (`IterableDataset`) resumed where it was without the core's warning that it starts the epoch again."""
    path = str(tmp_path / "ckpt.pt")
    uninterrupted = _job(lighthouse, strategy, shuffle, str(tmp_path / "never-written.pt"))
    assert len(uninterrupted) == 20 and uninterrupted[:10] != uninterrupted[10:]  # two epochs, two orders
    before = _job(lighthouse, strategy, shuffle, path, "6")
    after = _job(lighthouse, strategy, shuffle, path)
    assert before + after == uninterrupted
