"""One process: the Lite loop equals plain PyTorch bit for bit, and the API behaves like the originals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import mse_steps  # the repository's conftest.py
from lite_core import LightningLite
from lite_core.errors import MisuseError


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _plain_loop(model: nn.Module, steps_data: DataLoader) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return mse_steps(model, optimizer, steps_data, lambda loss: loss.backward())


class _Loop(LightningLite):
    def run(self, model: nn.Module, loader: DataLoader) -> list[float]:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = self.setup(model, optimizer)
        return mse_steps(model, optimizer, self.setup_dataloaders(loader), self.backward)


def test_32_true_matches_plain_pytorch_bit_for_bit() -> None:
    plain_model, lite_model = _model(), _model()
    plain = _plain_loop(plain_model, DataLoader(_data(), batch_size=8))
    lite = _Loop(accelerator="cpu", devices=1).run(lite_model, DataLoader(_data(), batch_size=8))
    assert lite == plain
    for a, b in zip(plain_model.parameters(), lite_model.parameters()):
        assert torch.equal(a, b)


def test_run_returns_value_and_can_be_called_twice() -> None:
    lite = _Loop(accelerator="cpu")
    first = lite.run(_model(), DataLoader(_data(), batch_size=16))
    second = lite.run(_model(), DataLoader(_data(), batch_size=16))
    assert len(first) == len(second) == 4
    assert lite.strategy.environment_ready


def test_launch_function_style_receives_lite() -> None:
    def train(lite: LightningLite, value: int) -> tuple[int, int]:
        return lite.world_size, value * 2

    assert LightningLite(accelerator="cpu").launch(train, 21) == (1, 42)


def test_run_not_overridden_says_what_to_do() -> None:
    with pytest.raises(NotImplementedError, match="put your loop in run"):
        LightningLite(accelerator="cpu").run()


def test_properties_on_one_process() -> None:
    lite = LightningLite(accelerator="cpu")
    assert (lite.global_rank, lite.local_rank, lite.node_rank, lite.world_size) == (0, 0, 0, 1)
    assert lite.is_global_zero and lite.device == torch.device("cpu")


def test_wrapped_model_keeps_keys_and_attributes() -> None:
    lite = LightningLite(accelerator="cpu")
    model = _model()
    model.custom_attribute = "kept"
    wrapped = lite.setup(model)
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert wrapped.custom_attribute == "kept"
    assert wrapped is model
    assert wrapped[0] is model[0]


def test_wrapped_containers_index_count_iterate_and_contain_like_the_originals() -> None:
    lite = LightningLite(accelerator="cpu")
    sequential = _model()
    wrapped = lite.setup(sequential)
    assert wrapped[0] is sequential[0] and len(wrapped) == 3 and list(wrapped) == list(sequential)
    assert isinstance(wrapped[1:], nn.Sequential)
    layers = nn.ModuleDict({"encoder": nn.Linear(2, 2)})
    wrapped_dict = lite.setup_module(layers)
    assert "encoder" in wrapped_dict and wrapped_dict["encoder"] is layers["encoder"]
    assert list(wrapped_dict) == ["encoder"]
    plain = lite.setup_module(nn.Linear(2, 2))  # a class without them keeps Python's errors
    with pytest.raises(TypeError):
        len(plain)
    with pytest.raises(TypeError):
        plain[0]
    assert bool(plain)
    copied = copy.deepcopy(wrapped)
    assert torch.equal(copied[0].weight, sequential[0].weight)


def test_wrapped_optimizer_is_the_users_class_and_shares_state() -> None:
    lite = LightningLite(accelerator="cpu")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    _, wrapped = lite.setup(model, optimizer)
    assert isinstance(wrapped, torch.optim.SGD)
    assert wrapped.param_groups is optimizer.param_groups
    scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.1)
    wrapped.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert wrapped.state_dict() == optimizer.state_dict()
    assert wrapped.optimizer is optimizer


def test_setting_up_the_same_object_twice_is_an_error() -> None:
    lite = LightningLite(accelerator="cpu")
    model = _model()
    wrapped = lite.setup(model)
    with pytest.raises(MisuseError, match="already set up"):
        lite.setup(model)
    with pytest.raises(MisuseError, match="already set up"):
        lite.setup(wrapped)
    loader = DataLoader(_data())
    lite.setup_dataloaders(loader)
    with pytest.raises(MisuseError, match="already set up"):
        lite.setup_dataloaders(loader)


def test_backward_before_setup_is_an_error() -> None:
    lite = LightningLite(accelerator="cpu")
    with pytest.raises(MisuseError, match="call setup"):
        lite.backward(torch.ones(1, requires_grad=True).sum())


def test_dataloader_wrapper_keeps_len_and_moves_batches() -> None:
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(_data(), batch_size=10))
    assert len(loader) == 7
    assert loader.batch_size == 10
    batches = list(loader)
    assert len(batches) == 7 and batches[0][0].device == lite.device


def test_setup_dataloaders_rejects_other_iterables() -> None:
    with pytest.raises(MisuseError, match="DataLoader"):
        LightningLite(accelerator="cpu").setup_dataloaders([1, 2, 3])


def test_clip_gradients_by_norm_and_value() -> None:
    lite = LightningLite(accelerator="cpu")
    model = lite.setup(_model())
    optimizer = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    lite.backward(model(torch.randn(4, 8)).sum() * 1000)
    norm = lite.clip_gradients(model, optimizer, max_norm=1.0)
    assert norm > 1.0
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert total == pytest.approx(1.0, rel=1e-4)
    lite.clip_gradients(model, optimizer, clip_val=0.01)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.01
    with pytest.raises(MisuseError, match="exactly one"):
        lite.clip_gradients(model, optimizer)


def test_to_device_print_and_collectives_on_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    lite = LightningLite(accelerator="cpu")
    batch = {"x": torch.ones(2), "y": [torch.zeros(1)]}
    assert lite.to_device(batch)["y"][0].device == lite.device
    lite.print("hello")
    assert capsys.readouterr().out == "hello\n"
    lite.barrier()
    assert lite.broadcast({"a": 1}) == {"a": 1}
    assert lite.all_gather(torch.tensor([1.0])).shape == (1, 1)
    assert torch.equal(lite.all_reduce(torch.tensor([3.0])), torch.tensor([3.0]))
    with lite.rank_zero_first():
        pass
    with lite.no_backward_sync(lite.setup(_model())):
        pass


def test_init_module_builds_in_the_precision() -> None:
    lite = LightningLite(accelerator="cpu", precision="64-true")
    with lite.init_module():
        layer = nn.Linear(2, 2)
    assert layer.weight.dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32


def test_loggers_and_callbacks() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.seen: list[tuple[dict[str, float], int | None]] = []

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.seen.append((metrics, step))

        def on_epoch_end(self, epoch: int) -> None:
            self.seen.append(({"epoch": epoch}, None))

    recorder = Recorder()
    lite = LightningLite(accelerator="cpu", loggers=recorder, callbacks=[recorder, object()])
    lite.log("loss", torch.tensor(0.5), step=3)
    lite.call("on_epoch_end", 7)
    assert recorder.seen == [({"loss": 0.5}, 3), ({"epoch": 7}, None)]


def test_deepcopy_of_model_before_setup_is_unaffected() -> None:
    model = _model()
    snapshot = copy.deepcopy(model.state_dict())
    LightningLite(accelerator="cpu").setup(model)
    assert all(torch.equal(snapshot[k], v) for k, v in model.state_dict().items())


def test_hooks_on_the_wrapper_still_fire() -> None:
    lite = LightningLite(accelerator="cpu")
    wrapped = lite.setup(_model())
    calls = []
    wrapped.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    wrapped(torch.ones(2, 8))
    assert calls == [torch.Size([2, 1])]


def test_backward_needs_model_when_the_strategy_says_so_and_several_are_set_up() -> None:
    from lite_core.strategies.single_device import SingleDeviceStrategy

    class PerModelBackward(SingleDeviceStrategy):
        backward_needs_model = True

    lite = LightningLite(accelerator="cpu", strategy=PerModelBackward())
    first, second = lite.setup(_model()), lite.setup(_model())
    x = torch.randn(2, 8)
    loss = first(x).sum() + second(x).sum()
    with pytest.raises(MisuseError, match=r"call backward\(loss, model=model\)"):
        lite.backward(loss)
    lite.backward(loss, model=first)  # naming the model works
    assert next(first.parameters()).grad is not None
    plain = LightningLite(accelerator="cpu")  # the default strategy needs no model
    one, two = plain.setup(_model()), plain.setup(_model())
    plain.backward(one(x).sum() + two(x).sum())


def test_one_process_pays_nothing_for_the_discarded_setup_check() -> None:
    """Only distributed strategies, a wrapper or a precision that changes the forward route
    `model(x)` through Lite: a plain one-process model's call is the user's class's own."""
    lite = LightningLite(accelerator="cpu")
    model = lite.setup(nn.Linear(2, 1))
    assert type(model).__call__ is nn.Linear.__call__
    original = nn.Linear(2, 1)
    lite.backward(original(torch.ones(1, 2)).sum())  # one process: no synchronisation to miss
    assert original.weight.grad is not None
