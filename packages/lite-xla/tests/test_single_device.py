"""One XLA device, for real on XLA's CPU device: training parity, precision, data, checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.errors import MisuseError
from lite_core.plugins import forward_module


def _data(batch_size: int = 16) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 4, generator=generator),
                                    torch.randn(64, 1, generator=generator)), batch_size=batch_size)


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def _train_epochs(model: nn.Module, optimizer: Any, loader: Any, backward: Callable[[torch.Tensor], None],
                  epochs: int, scheduler: Any = None) -> list[float]:
    """The user's loop; `backward` is `loss.backward` in plain PyTorch, `lite.backward` under Lite;
    a `scheduler` steps after every optimizer step."""
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(loss.item())
    return losses


def _plain_pytorch(optimizer_name: str, epochs: int) -> tuple[list[float], list[torch.Tensor]]:
    model = _model()
    optimizer = _OPTIMIZERS[optimizer_name](model.parameters())
    losses = _train_epochs(model, optimizer, _data(), lambda loss: loss.backward(), epochs)
    return losses, [p.detach().clone() for p in model.parameters()]


class _Train(LightningLite):
    def run(self, optimizer_name: str, epochs: int) -> tuple[list[float], list[torch.Tensor]]:
        model = _model()
        optimizer = _OPTIMIZERS[optimizer_name](model.parameters())  # made before setup()
        model, optimizer = self.setup(model, optimizer)
        losses = _train_epochs(model, optimizer, self.setup_dataloaders(_data()), self.backward, epochs)
        return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("strategy", ["auto", "xla_fsdp"])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_training_matches_plain_cpu_pytorch(optimizer_name: str, strategy: str) -> None:
    expected_losses, expected_weights = _plain_pytorch(optimizer_name, epochs=2)
    lite = _Train(accelerator="tpu", strategy=strategy, devices=1)
    losses, weights = lite.run(optimizer_name, epochs=2)
    assert lite.device.type == "xla"
    assert losses == pytest.approx(expected_losses, abs=1e-5)
    if strategy == "auto":  # the sharded model's parameters are flat shards
        for got, want in zip(weights, expected_weights):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class _Collectives(LightningLite):
    def run(self) -> dict[str, Any]:
        correct = torch.tensor([3, 4], device=self.device)
        total = self.all_reduce(correct, reduce_op="sum")
        total += 1
        gathered = self.all_gather(correct)
        gathered += 1
        mean = self.all_reduce(correct, reduce_op="mean")
        return {"input": correct.cpu().tolist(), "mean": mean.cpu().tolist(), "mean_dtype": mean.dtype}


@pytest.mark.parametrize("strategy", ["auto", "xla"])
def test_one_replica_collectives_return_new_tensors_as_several_do(strategy: str) -> None:
    seen = _Collectives(accelerator="tpu", strategy=strategy, devices=1).run()
    assert seen == {"input": [3, 4], "mean": [3.0, 4.0], "mean_dtype": torch.float32}


def test_optimizer_made_before_setup_steps_the_parameters_on_the_device() -> None:
    lite = LightningLite(accelerator="tpu", devices=1)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    model, optimizer = lite.setup(model, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert all(p.device.type == "xla" for p in params)


def test_batches_come_through_the_parallel_device_loader() -> None:
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    lite = LightningLite(accelerator="tpu", devices=1)
    loader = lite.setup_dataloaders(_data(batch_size=10))
    assert isinstance(lite.strategy.process_dataloader(loader.dataloader), MpDeviceLoader)
    batches = list(loader)
    assert len(loader) == len(batches) == 7
    assert all(x.device.type == "xla" and y.device.type == "xla" for x, y in batches)
    torch.testing.assert_close(torch.cat([x.cpu() for x, _ in batches]), _data().dataset.tensors[0])
    assert lite.strategy.distributed_sampler_kwargs() is None  # one device: the user's sampler stays


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A batch as a user's collate function may return it."""

    inputs: torch.Tensor
    extras: dict[str, Any]


class _Encoding:
    """A tokenizer-output-like object with its own `.to(device)`."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def to(self, device: torch.device) -> _Encoding:
        return _Encoding(self.ids.to(device))


def _collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> _Batch:
    x = torch.stack([s[0] for s in samples])
    return _Batch(x, {"target": torch.stack([s[1] for s in samples]), "encoding": _Encoding(x.argmax(dim=1))})


def test_dataclass_and_to_objects_in_a_batch_reach_the_device() -> None:
    lite = LightningLite(accelerator="tpu", devices=1)
    loader = lite.setup_dataloaders(DataLoader(_data().dataset, batch_size=16, collate_fn=_collate))
    batches = list(loader)
    assert len(batches) == 4 and all(isinstance(b, _Batch) for b in batches)
    for batch in batches:
        assert batch.inputs.device.type == "xla"
        assert batch.extras["target"].device.type == "xla"
        assert batch.extras["encoding"].ids.device.type == "xla"
    torch.testing.assert_close(torch.cat([b.inputs.cpu() for b in batches]), _data().dataset.tensors[0])
    moved = lite.to_device(_Batch(torch.ones(2), {"encoding": _Encoding(torch.zeros(2))}))
    assert moved.inputs.device.type == "xla" and moved.extras["encoding"].ids.device.type == "xla"


def test_batch_already_on_the_device_is_not_moved_again() -> None:
    lite = LightningLite(accelerator="tpu", devices=1)
    lite.strategy.setup_environment()
    on_device = torch.ones(2).to(lite.device)
    moved = lite.strategy.batch_to_device({"a": on_device, "b": torch.zeros(1)})
    assert moved["a"] is on_device and moved["b"].device.type == "xla"


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.seen.append(out.dtype)
        return out


@pytest.mark.parametrize(("precision", "param_dtype", "inner_dtype"), [
    ("32-true", torch.float32, torch.float32),
    ("bf16-mixed", torch.float32, torch.bfloat16),
    ("bf16-true", torch.bfloat16, torch.bfloat16),
])
def test_precision(precision: str, param_dtype: torch.dtype, inner_dtype: torch.dtype) -> None:
    lite = LightningLite(accelerator="tpu", devices=1, precision=precision)
    probe = _Probe()
    model, optimizer = lite.setup(probe, torch.optim.SGD(probe.parameters(), lr=0.1))
    out = model(lite.to_device(torch.randn(3, 4)))
    assert probe.seen == [inner_dtype]
    assert out.dtype == (torch.float32 if precision == "bf16-mixed" else param_dtype)
    assert all(p.dtype == param_dtype for p in model.parameters())
    lite.backward(out.float().sum())
    optimizer.step()
    assert torch.isfinite(torch.stack([p.float().sum() for p in model.parameters()]).cpu()).all()
    with lite.autocast():
        assert lite._plan.precision.name == precision


def test_save_writes_cpu_tensors_and_load_restores_on_the_device(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="tpu", devices=1)
    model = _model()
    model, optimizer = lite.setup(model, torch.optim.Adam(model.parameters()))
    lite.backward(model(lite.to_device(torch.randn(2, 4))).sum())
    optimizer.step()
    path = tmp_path / "checkpoint.pt"
    lite.save({"model": model, "optimizer": optimizer, "step": 3}, path)

    raw = torch.load(path, weights_only=True)
    assert raw["step"] == 3
    assert all(t.device.type == "cpu" for t in raw["model"].values())
    assert all(t.device.type == "cpu" for s in raw["optimizer"]["state"].values() for t in s.values())

    fresh = LightningLite(accelerator="tpu", devices=1)
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    other, other_optimizer = fresh.setup(other, torch.optim.Adam(other.parameters()))
    state = {"model": other, "optimizer": other_optimizer, "step": 0}
    fresh.load(path, state)
    assert state["step"] == 3
    for got, want in zip(other.parameters(), model.parameters()):
        assert got.device.type == "xla"
        torch.testing.assert_close(got.cpu(), want.cpu())
    assert other_optimizer.state_dict()["state"][0]["step"] == 1


def test_xla_fsdp_refuses_an_optimizer_on_unsharded_parameters() -> None:
    def body(lite: LightningLite) -> None:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        lite.setup_module(model)
        lite.setup_optimizers(optimizer)

    lite = LightningLite(accelerator="tpu", strategy="xla_fsdp", devices=1)
    with pytest.raises(MisuseError, match="shards the model's parameters.*setup_module\\(\\) returned"):
        lite.launch(body)


def test_xla_fsdp_points_the_optimizer_at_the_sharded_parameters() -> None:
    def body(lite: LightningLite) -> None:
        model = _model()
        model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5))
        sharded = {id(p) for p in forward_module(model).parameters()}
        assert {id(p) for group in optimizer.param_groups for p in group["params"]} == sharded
        assert optimizer.param_groups[0]["lr"] == 0.25 and optimizer.param_groups[0]["momentum"] == 0.5

    LightningLite(accelerator="tpu", strategy="xla_fsdp", devices=1).launch(body)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_xla_fsdp_trains_with_an_optimizer_made_from_the_set_up_models_parameters(optimizer_name: str) -> None:
    """The order the refusal above asks for: `setup_module`, then an optimizer on its `parameters()`
    (the shards), then `setup_optimizers`; it trains as plain PyTorch does."""
    expected_losses, _ = _plain_pytorch(optimizer_name, epochs=2)

    def body(lite: LightningLite) -> tuple[list[float], bool, list[str]]:
        model = lite.setup_module(_model())
        optimizer = lite.setup_optimizers(_OPTIMIZERS[optimizer_name](model.parameters()))
        sharded = {id(p) for p in forward_module(model).parameters()} == {id(p) for p in model.parameters()}
        names = [name for name, _ in model.named_parameters()]
        return _train_epochs(model, optimizer, lite.setup_dataloaders(_data()), lite.backward, 2), sharded, names

    losses, sharded, names = LightningLite(accelerator="tpu", strategy="xla_fsdp", devices=1).launch(body)
    assert sharded  # what parameters() yields after set-up are the shards on torch-xla's wrapper
    assert names == [name for name, _ in _model().named_parameters()]  # under the model's own names
    assert losses == pytest.approx(expected_losses, abs=1e-5)


def _groups_state_and_scheduler(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """Two groups with their own lr, momentum already held (one CPU step), a StepLR on top."""
    optimizer = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.02}],
                                lr=0.1, momentum=0.9)
    x, y = next(iter(_data()))
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def test_xla_fsdp_keeps_the_users_optimizer_with_its_groups_state_and_scheduler() -> None:
    model = _model()
    optimizer, scheduler = _groups_state_and_scheduler(model)
    expected = _train_epochs(model, optimizer, _data(), lambda loss: loss.backward(), 1, scheduler)

    def body(lite: LightningLite) -> tuple[list[float], bool]:
        model = _model()
        optimizer, scheduler = _groups_state_and_scheduler(model)
        model, wrapped = lite.setup(model, optimizer)
        same = wrapped.optimizer is optimizer and scheduler.optimizer is optimizer
        return _train_epochs(model, wrapped, lite.setup_dataloaders(_data()), lite.backward, 1, scheduler), same

    losses, same_object = LightningLite(accelerator="tpu", strategy="xla_fsdp", devices=1).launch(body)
    assert same_object
    assert losses == pytest.approx(expected, abs=1e-5)


def test_xla_fsdp_saves_shards_that_load_back_and_consolidate(tmp_path: Path) -> None:
    path = tmp_path / "sharded"

    def train_and_save(lite: LightningLite) -> tuple[list[torch.Tensor], torch.Tensor]:
        model = _model()
        model, optimizer = lite.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
        lite.backward(model(lite.to_device(torch.randn(2, 4))).sum())
        optimizer.step()
        lite.save({"model": model, "optimizer": optimizer, "step": 7}, path)
        probe = model(lite.to_device(torch.ones(3, 4))).detach().cpu()
        return [p.detach().cpu().clone() for p in forward_module(model).parameters()], probe

    def load_back(lite: LightningLite) -> tuple[int, list[torch.Tensor], int]:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        model, optimizer = lite.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        lite.load(path, state)
        steps = int(optimizer.state_dict()["state"][0]["step"])
        return state["step"], [p.detach().cpu() for p in forward_module(model).parameters()], steps

    saved, probe = LightningLite(accelerator="tpu", strategy="xla_fsdp", devices=1).launch(train_and_save)
    assert [f.name for f in path.iterdir()] == ["shard-00000-of-00001.pt"]
    step, loaded, optimizer_steps = LightningLite(accelerator="tpu", strategy="xla_fsdp", devices=1).launch(load_back)
    assert step == 7 and optimizer_steps == 1
    for got, want in zip(loaded, saved):
        torch.testing.assert_close(got, want)

    from lite_xla import consolidate_checkpoint

    full = consolidate_checkpoint(path)
    assert full["step"] == 7 and "optimizer" not in full
    plain = _model()
    plain.load_state_dict(full["model"])  # the user's module's own keys and shapes
    assert set(full["model"]) == set(plain.state_dict())
    torch.testing.assert_close(plain(torch.ones(3, 4)), probe, atol=1e-5, rtol=0)  # the trained model
    assert not torch.allclose(_model()(torch.ones(3, 4)), probe)


def test_a_url_is_refused_in_one_sentence_as_torch_xla_writes_local_files_only(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from lite_core.errors import CheckpointError

    monkeypatch.chdir(tmp_path)
    lite = LightningLite(accelerator="tpu", devices=1)
    model = lite.setup(_model())
    for call in (lambda: lite.save({"model": model}, "memory://bucket/ckpt"), lambda: lite.load("s3://bucket/ckpt")):
        with pytest.raises(CheckpointError, match="writes and reads checkpoints on the local file system only") as info:
            call()
        assert str(info.value).endswith(".") and ". " not in str(info.value)
    assert list(tmp_path.iterdir()) == []
