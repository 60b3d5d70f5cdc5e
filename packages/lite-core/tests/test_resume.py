"""Exact resume on one process: a shuffled run saved at an epoch boundary and resumed equals the
uninterrupted run bit for bit; the set-up loader's position travels in the checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from conftest import mse_steps  # the repository's conftest.py
from lite_core import LightningLite

EPOCHS, SAVE_AFTER = 4, 2


class Train(LightningLite):
    def run(self, checkpoint: Path, resume: bool, seed: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(seed)  # a resumed run starts from other weights and another random state
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = self.setup(model, optimizer)
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(24, 4, generator=generator), torch.randn(24, 1, generator=generator))
        loader = self.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
        state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0}
        if resume:
            self.load(checkpoint, state)
        losses = []
        for epoch in range(state["epoch"], EPOCHS):
            losses += mse_steps(model, optimizer, loader, self.backward)
            state["epoch"] = epoch + 1
            if not resume and epoch + 1 == SAVE_AFTER:
                self.save(state, checkpoint)
        return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_shuffled_run_resumed_at_an_epoch_boundary_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    losses, weights = Train(accelerator="cpu").run(tmp_path / "ckpt.pt", resume=False, seed=0)
    resumed_losses, resumed_weights = Train(accelerator="cpu").run(tmp_path / "ckpt.pt", resume=True, seed=123)
    per_epoch = len(losses) // EPOCHS
    assert resumed_losses == losses[SAVE_AFTER * per_epoch:]  # bit for bit: same shuffles, same dropout
    for key, value in weights.items():
        assert torch.equal(resumed_weights[key], value), key


def test_the_loader_position_is_saved_and_restored(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True))
    for _ in range(3):
        list(loader)
    lite.save({"loader": loader}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    assert state["epoch"] == 3 and "torch_rng_state" in state
    fresh = lite.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True))
    lite.load(tmp_path / "ckpt.pt", {"loader": fresh})
    assert fresh.state_dict()["epoch"] == 3


def test_a_set_epoch_the_user_calls_is_respected() -> None:
    lite = LightningLite(accelerator="cpu")
    sampler = DistributedSampler(TensorDataset(torch.arange(16.0)), num_replicas=1, rank=0, shuffle=True, seed=5)
    loader = lite.setup_dataloaders(DataLoader(TensorDataset(torch.arange(16.0)), sampler=sampler, batch_size=16),
                                    replace_sampler=False)
    expected = DistributedSampler(TensorDataset(torch.arange(16.0)), num_replicas=1, rank=0, shuffle=True, seed=5)

    def order_of(epoch: int) -> list[int]:
        expected.set_epoch(epoch)
        return list(expected)

    assert next(iter(loader))[0].long().tolist() == order_of(0)  # Lite counts epochs: 0, 1, ...
    loader.sampler.set_epoch(7)  # the user's own epoch wins ...
    assert next(iter(loader))[0].long().tolist() == order_of(7)
    assert next(iter(loader))[0].long().tolist() == order_of(8)  # ... and counting goes on from it


def test_a_stateful_dataloader_resumes_inside_the_epoch(tmp_path: Path) -> None:
    stateful = __import__("pytest").importorskip("torchdata.stateful_dataloader")
    data = TensorDataset(torch.arange(12.0))

    def loader(lite: LightningLite) -> object:
        torch.manual_seed(3)
        return lite.setup_dataloaders(stateful.StatefulDataLoader(data, batch_size=2, shuffle=True))

    lite = LightningLite(accelerator="cpu")
    uninterrupted = [batch[0].tolist() for batch in loader(lite)]
    interrupted = loader(lite)
    seen = []
    for batch in interrupted:
        seen.append(batch[0].tolist())
        if len(seen) == 2:
            lite.save({"loader": interrupted}, tmp_path / "ckpt.pt")  # in the middle of the epoch
            break
    resumed = loader(lite)
    lite.load(tmp_path / "ckpt.pt", {"loader": resumed})
    assert seen + [batch[0].tolist() for batch in resumed] == uninterrupted
    assert resumed.state_dict()["epoch"] == 1  # the interrupted epoch counted once
