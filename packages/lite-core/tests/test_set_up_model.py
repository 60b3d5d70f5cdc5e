"""The set-up model is the model, on one process: `generate` and the methods named in
`setup(forward_methods=...)` run under the precision and through the strategy's forward, every
other method on the module as it is, tensors among its arguments or not; other attributes and
`nn.Module`'s own methods keep their meaning; a `torch.compile`d model is wrapped plain and
compiled again, with plain keys.

The same under `ddp`, `ddp_spawn`, `fsdp` (2 processes) and with a Hugging Face GPT-2:
tests/integration/test_set_up_model.py; under DeepSpeed: lite-deepspeed's tests.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

from typing import Any

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import MisuseError
from lite_core.plugins import forward_module
from lite_core.strategies import SingleDeviceStrategy


class Settings:
    """A config object, as Hugging Face models carry one."""

    width = 4


@dataclasses.dataclass
class Batch:
    x: torch.Tensor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.settings = Settings()
        self.layer = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def generate(self, x: torch.Tensor, steps: int = 2) -> torch.Tensor:
        """Apply the layer `steps` times."""
        for _ in range(steps):
            x = self(x)  # the real forward, also while generate itself runs as the forward pass
        return x

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).pow(2).mean() * self.scale

    def encode(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Takes its tensors in a mapping, as from a tokenizer's `BatchEncoding`."""
        return self(batch["x"])

    def score(self, batch: Batch) -> torch.Tensor:
        """Takes its tensors in a dataclass, as many users' batches come."""
        return self(batch.x)

    def write(self, folder: str, state_dict: dict[str, torch.Tensor] | None = None) -> str:
        """A utility that computes nothing from an input, as `save_pretrained(folder, state_dict=...)`."""
        return folder

    def direct(self, x: torch.Tensor) -> torch.Tensor:
        """Computes with the weights without calling `self(...)`."""
        return self.layer(x) * self.scale

    @property
    def width(self) -> int:
        return self.settings.width

    @classmethod
    def build(cls) -> Net:
        return cls()


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _dtypes_computed(model: Net) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    model.layer.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    return seen


def test_a_method_runs_under_the_precision() -> None:
    plain = _net()
    seen = _dtypes_computed(plain)
    model = LightningLite(accelerator="cpu", devices=1, precision="bf16-mixed").setup(plain)
    model.generate(torch.randn(2, 4))
    assert seen == [torch.bfloat16, torch.bfloat16]


class _Wrapper(nn.Module):
    """A strategy's wrapper: does its own work around one call of the module it holds, as DDP does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: list[tuple[Any, ...]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(args)
        return self.module(*args, **kwargs)


class _WrappingStrategy(SingleDeviceStrategy):
    def setup_module(self, module: nn.Module, *, precision: Any) -> nn.Module:
        return _Wrapper(module)


class _IgnoringWrapper(_Wrapper):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.zeros(())


class _IgnoringStrategy(SingleDeviceStrategy):
    def setup_module(self, module: nn.Module, *, precision: Any) -> nn.Module:
        return _IgnoringWrapper(module)


def test_a_method_runs_as_one_forward_pass_of_the_strategys_wrapper() -> None:
    plain, reference = _net(), _net()
    model = LightningLite(accelerator="cpu", strategy=_WrappingStrategy()).setup(plain)
    x = torch.randn(3, 4)
    loss = model.training_step(x)
    assert torch.equal(loss, reference.training_step(x))
    out = model.generate(x, steps=3)
    assert torch.equal(out, reference.generate(x, steps=3))
    wrapper = forward_module(model)
    assert [len(args) for args in wrapper.calls] == [1, 1]  # once per method call, whatever it calls inside
    assert "forward" not in vars(plain)  # the user's forward is its own again afterwards


def test_a_method_with_tensor_arguments_runs_on_the_module_unless_it_is_a_forward_method() -> None:
    """`save_pretrained(folder, state_dict=full)` on one rank must not enter the strategy's forward
    (its collectives would wait for the other ranks): only `generate` and the named methods do."""
    plain, reference = _net(), _net()
    model = LightningLite(accelerator="cpu", strategy=_WrappingStrategy()).setup(plain)
    wrapper = forward_module(model)
    x = torch.randn(3, 4)
    assert model.write("folder", state_dict=model.state_dict()) == "folder"
    assert torch.equal(model.direct(x), reference.direct(x))
    assert wrapper.calls == []
    # Methods that call the model: their `self(x)` is `model(x)`, one pass of the wrapper each.
    assert torch.equal(model.encode({"x": x}), reference(x))
    assert torch.equal(model.score(Batch(x)), reference(x))
    assert len(wrapper.calls) == 2


def test_a_named_method_runs_as_one_forward_pass_of_the_wrapper() -> None:
    plain, reference = _net(), _net()
    model = LightningLite(accelerator="cpu", strategy=_WrappingStrategy()).setup(plain, forward_methods=["direct"])
    wrapper = forward_module(model)
    x = torch.randn(3, 4)
    assert torch.equal(model.direct(x), reference.direct(x))
    assert len(wrapper.calls) == 1
    assert "forward" not in vars(plain)


def test_a_named_method_runs_under_the_precision() -> None:
    plain = _net()
    seen = _dtypes_computed(plain)
    lite = LightningLite(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = lite.setup_module(plain, forward_methods="direct")  # one name alone
    assert model.direct(torch.randn(2, 4)).dtype == torch.float32  # the output converted back, as model(x)'s
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])  # nothing routed, and routed
@pytest.mark.parametrize("name", ["trainig_step", "state_dict", "width"])
def test_a_forward_method_the_class_does_not_define_is_refused_at_setup(precision: str, name: str) -> None:
    lite = LightningLite(accelerator="cpu", devices=1, precision=precision)
    with pytest.raises(MisuseError, match=rf"names '{name}', which is not a method of Net") as info:
        lite.setup(_net(), forward_methods=[name])
    assert ". " not in str(info.value) and str(info.value).endswith(".")


def test_a_wrapper_that_never_calls_the_module_is_an_error_not_a_wrong_result() -> None:
    model = LightningLite(accelerator="cpu", strategy=_IgnoringStrategy()).setup(_net())
    with pytest.raises(MisuseError, match=r"did not call Net in its forward.*forward\(\) instead"):
        model.generate(torch.randn(3, 4))


def test_attributes_that_are_not_methods_pass_through_and_module_methods_keep_their_meaning() -> None:
    plain = _net()
    model = LightningLite(accelerator="cpu", devices=1, precision="bf16-mixed").setup(plain)
    assert model.layer is plain.layer and model.settings is plain.settings and model.scale is plain.scale
    assert model.width == 4 and isinstance(model.build(), Net)  # property, classmethod
    assert list(model.state_dict()) == list(plain.state_dict())
    assert {id(p) for p in model.parameters()} == {id(p) for p in plain.parameters()}
    model.eval()
    assert not plain.training
    model.train()
    assert plain.training
    assert model.to(torch.device("cpu")) is model
    assert model.generate.__doc__ == Net.generate.__doc__ and model.generate.__name__ == "generate"


# -- torch.compile -------------------------------------------------------------------------------
#: inductor fuses and reorders float32 arithmetic: a compiled step may differ from the eager one in
#: the last bits (here it does not at all); far below what a wrong step changes.
COMPILE = 1e-5


def _train(model: Any, optimizer: torch.optim.Optimizer, backward: Any) -> list[float]:
    generator = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        x = torch.randn(4, 4, generator=generator)
        loss = model(x).pow(2).mean()
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.usefixtures("inductor_cache")
def test_a_compiled_model_trains_as_the_uncompiled_one_with_plain_keys_both_ways(tmp_path) -> None:
    eager = _net()
    expected = _train(eager, torch.optim.SGD(eager.parameters(), lr=0.1), lambda loss: loss.backward())
    lite = LightningLite(accelerator="cpu", devices=1)
    plain = _net()
    model, optimizer = lite.setup(torch.compile(plain), torch.optim.SGD(plain.parameters(), lr=0.1))
    assert model is plain
    losses = _train(model, optimizer, lite.backward)
    assert torch.allclose(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=COMPILE)
    assert list(model.state_dict()) == list(eager.state_dict())
    lite.save({"model": model}, tmp_path / "compiled.ckpt")
    uncompiled = lite.setup(_net())
    lite.load(tmp_path / "compiled.ckpt", {"model": uncompiled})
    lite.save({"model": uncompiled}, tmp_path / "eager.ckpt")
    compiled_again = lite.setup(torch.compile(_net()))
    lite.load(tmp_path / "eager.ckpt", {"model": compiled_again})
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(uncompiled(x), model(x)) and torch.equal(compiled_again(x), model(x))


def test_setting_up_a_compiled_and_set_up_model_again_is_refused() -> None:
    lite = LightningLite(accelerator="cpu", devices=1)
    plain = _net()
    compiled = torch.compile(plain)
    model = lite.setup(compiled)
    for again in (torch.compile(model), compiled, plain):
        with pytest.raises(MisuseError, match="already set up by Lite"):
            lite.setup(again)


# -- in place: copies, and changes the strategy cannot follow --------------------------------------
def test_a_copy_or_pickle_of_the_set_up_model_is_a_plain_model_of_the_users_class() -> None:
    plain = _net()
    model = LightningLite(accelerator="cpu", devices=1, precision="bf16-mixed").setup(plain)
    assert model is plain and isinstance(model, Net) and type(model).__name__ == "Net"
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(copied) is Net and "_lite_set_up" not in vars(copied)
        assert torch.equal(copied.layer.weight, model.layer.weight) and copied.layer.weight is not model.layer.weight


class _FixedLayoutStrategy(SingleDeviceStrategy):
    """A strategy that, like DDP, cannot follow conversions or new parameters after setup."""

    follows_conversions = False
    follows_new_parameters = False


def test_a_change_the_strategy_cannot_follow_is_refused_before_it_happens() -> None:
    model = LightningLite(accelerator="cpu", strategy=_FixedLayoutStrategy()).setup(_net())
    with pytest.raises(MisuseError, match=r"converted from torch.float32 on cpu to torch.float64 .* before setup\(\)"):
        model.double()
    assert model.layer.weight.dtype == torch.float32
    model.float().to("cpu")  # changes nothing: fine
    with pytest.raises(MisuseError, match=r"submodule 'head' with new parameters was added .* before setup\(\)"):
        model.head = nn.Linear(4, 1)
    with pytest.raises(MisuseError, match=r"parameter 'extra' was added to the model after setup"):
        model.layer.register_parameter("extra", nn.Parameter(torch.ones(1)))
    model.act = nn.ReLU()  # no parameters: fine
    model.layer = model.layer  # the parameters it was set up with: fine
    assert [name for name, _ in model.named_parameters()] == ["layer.weight", "layer.bias"]


def test_the_new_parameter_hooks_belong_to_the_lite_that_set_the_model_up() -> None:
    """torch's module registration hooks are global; each LightningLite registers its own with its
    first guarded model and they go with it (no process-wide flag that the first call sets)."""
    import gc

    from torch.nn.modules import module as torch_module

    gc.collect()  # models of earlier tests, and their hooks, gone first
    before = (len(torch_module._global_parameter_registration_hooks), len(torch_module._global_module_registration_hooks))
    lite = LightningLite(accelerator="cpu", strategy=_FixedLayoutStrategy())
    model = lite.setup(_net())
    other = LightningLite(accelerator="cpu", strategy=_FixedLayoutStrategy()).setup(_net())
    with pytest.raises(MisuseError, match=r"parameter 'extra' was added to the model after setup"):
        model.layer.register_parameter("extra", nn.Parameter(torch.ones(1)))
    with pytest.raises(MisuseError, match=r"parameter 'extra' was added to the model after setup"):
        other.layer.register_parameter("extra", nn.Parameter(torch.ones(1)))
    del lite, model, other
    gc.collect()
    after = (len(torch_module._global_parameter_registration_hooks), len(torch_module._global_module_registration_hooks))
    assert after == before


class _ShardHolder(nn.Module):
    """A strategy's wrapper that, like torch-xla's FSDP, takes the module's parameters out of it
    and holds a copy of each itself (under names of its own)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        for name, param in list(module.layer.named_parameters()):
            self.register_parameter(f"shard_of_layer_{name}", nn.Parameter(param.detach().clone()))
            del module.layer._parameters[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.shard_of_layer_weight, self.shard_of_layer_bias)


class _ShardingStrategy(SingleDeviceStrategy):
    routes_named_parameters = True

    def setup_module(self, module: nn.Module, *, precision: Any) -> nn.Module:
        return _ShardHolder(module)

    def module_named_parameters(self, module: nn.Module, forward_module: nn.Module, prefix: str = "",
                                recurse: bool = True, remove_duplicate: bool = True) -> Any:
        for name, param in forward_module.named_parameters(recurse=False):
            yield prefix + name.replace("shard_of_layer_", "layer."), param


def test_parameters_are_the_ones_that_train_where_the_strategy_moved_them() -> None:
    model = LightningLite(accelerator="cpu", strategy=_ShardingStrategy()).setup(_net())
    holder = forward_module(model)
    assert [(name, param) for name, param in model.named_parameters()] == [
        ("layer.weight", holder.shard_of_layer_weight), ("layer.bias", holder.shard_of_layer_bias)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # as a user makes it after setup()
    before = holder.shard_of_layer_weight.detach().clone()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert not torch.equal(holder.shard_of_layer_weight, before)
    # A strategy that leaves the parameters where they are adds nothing to the model's class.
    plain = LightningLite(accelerator="cpu", strategy=_WrappingStrategy()).setup(_net())
    assert type(plain).named_parameters is nn.Module.named_parameters


def test_a_one_process_model_takes_every_change_as_plain_pytorch_does() -> None:
    model = LightningLite(accelerator="cpu", devices=1).setup(_net())
    model.double()
    model.head = nn.Linear(4, 1)
    assert model.layer.weight.dtype == torch.float64 and "head.weight" in model.state_dict()


def test_the_set_up_models_class_builds_the_users_class_and_bare_copies() -> None:
    model = LightningLite(accelerator="cpu", devices=1, precision="bf16-mixed").setup(nn.Sequential(nn.Linear(2, 2)))
    assert type(model[0:1]) is nn.Sequential  # slicing calls type(model)(...)
    bare = type(model).__new__(type(model))  # as DataParallel's replicas are made: no __init__ runs
    assert isinstance(bare, nn.Sequential) and not vars(bare)
