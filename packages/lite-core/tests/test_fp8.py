"""FP8 precision (torchao's float8 training) on one process: the same loop converted by hand, the
layers it converts, the refusals, and the peak it measures MFU against. The 2-process cases
(ddp, fsdp, checkpoint moves) are in tests/integration/sharded/test_fp8.py."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn

from lite_core import Float8Precision, LightningLite, ThroughputMonitor
from lite_core.accelerators.cpu import CPUAccelerator
from lite_core.errors import ConfigurationError, MissingDependencyError
from lite_core.strategies import SingleDeviceStrategy

torchao_float8 = pytest.importorskip("torchao.float8", reason="needs lite-core[fp8] (torchao), which the test"
                                                              " environment installs")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16: FP8 matmuls cannot take it
        self.down = nn.Linear(40, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.odd(torch.relu(self.up(x)))))))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)) for _ in range(3)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, autocast: bool, backward=torch.Tensor.backward) -> list:
    losses = []
    for x, y in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def converted_by_hand(recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return convert_to_float8_training(Net(), config=config, module_filter_fn=lambda m, name: name in ("up",))


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-around", "fp32-around"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_process_trains_bitwise_as_the_loop_converted_by_hand(recipe, autocast) -> None:
    lite = LightningLite(accelerator="cpu", precision=Float8Precision(
        recipe, emulate=True, autocast_dtype=torch.bfloat16 if autocast else None))
    torch.manual_seed(0)
    model = Net()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = train(model, optimizer, autocast=False, backward=lite.backward)  # Lite applies the autocast
    plain = converted_by_hand(recipe)
    plain_losses = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), autocast=autocast)
    assert losses == plain_losses
    for (name, value), (plain_name, plain_value) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert name == plain_name and torch.equal(value, plain_value), name


def test_every_linear_converts_but_the_last_and_those_not_a_multiple_of_16_unless_the_user_filters() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = LightningLite(accelerator="cpu", precision=Float8Precision(emulate=True)).setup(Net())
    converted = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    assert converted == {"up"}  # `odd` and `down` have a 40; `head` is the last Linear
    assert isinstance(model.head, nn.Linear) and sorted(model.state_dict()) == sorted(Net().state_dict())
    chosen = Float8Precision(emulate=True, module_filter_fn=lambda module, name: name in ("up", "head"))
    model = LightningLite(accelerator="cpu", precision=chosen).setup(Net())
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == {"up", "head"}


def test_without_fp8_hardware_the_precision_is_refused_and_emulation_named() -> None:
    with pytest.raises(ConfigurationError, match=(
            r"^precision='fp8-tensorwise' is not supported by strategy='single_device' on accelerator='cpu': choose"
            r" one of \[.*\], or emulate FP8 \(slow; for tests and debugging\) with"
            r" precision=Float8Precision\('tensorwise', emulate=True\).$")):
        LightningLite(accelerator="cpu", precision="fp8-tensorwise")
    with pytest.raises(ConfigurationError, match=r"^precision='fp8-rowwise' is not supported by strategy='single_"
                                                 r"device' on accelerator='cpu'"):
        LightningLite(accelerator="cpu", precision=Float8Precision())  # the object, without emulation


class WithoutFP8(SingleDeviceStrategy):
    """A strategy that declares no FP8 (as DeepSpeed's, fairscale's and XLA's do)."""

    supported_precisions = frozenset({"32-true", "bf16-mixed"})


def test_a_strategy_without_fp8_refuses_it_even_emulated() -> None:
    with pytest.raises(ConfigurationError, match=r"^precision='fp8-rowwise' is not supported by"
                                                 r" strategy='single_device' on accelerator='cpu': choose one of"
                                                 r" \['32-true', 'bf16-mixed'\].$"):
        LightningLite(accelerator="cpu", strategy=WithoutFP8(), precision=Float8Precision(emulate=True))


def test_fp8_spelled_another_way_is_guessed_and_a_wrong_recipe_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"^precision='fp8' is not supported: did you mean 'fp8-rowwise'\?"):
        LightningLite(accelerator="cpu", precision="fp8")
    with pytest.raises(ConfigurationError, match=r"^Float8Precision\(recipe='colwise'\) is not a recipe: pass one of"
                                                 r" \['tensorwise', 'rowwise'\].$"):
        Float8Precision("colwise")


def test_a_float8_all_gather_is_refused_with_rowwise_scales_and_without_fully_shard() -> None:
    with pytest.raises(ConfigurationError, match=r"^Float8Precision\(recipe='rowwise', fsdp_float8_all_gather=True\)"
                                                 r" asks for torchao's float8 all-gather, which supports only the"
                                                 r" tensorwise recipe: [^.]*\.$"):
        Float8Precision("rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(ConfigurationError, match=r"^Float8Precision\(fsdp_float8_all_gather=True\) all-gathers FSDP2's"
                                                 r" weights, but this strategy never shards them with fully_shard:"
                                                 r" [^.]*\.$"):
        LightningLite(accelerator="cpu", precision=Float8Precision("tensorwise", emulate=True,
                                                                   fsdp_float8_all_gather=True))


@pytest.mark.parametrize(("strategy", "recipe", "asked", "on"), [
    ("fsdp", "tensorwise", None, True), ("fsdp", "rowwise", None, False), ("fsdp", "tensorwise", False, False),
    ("ddp", "tensorwise", None, False), ("model_parallel", "tensorwise", None, False),
    ("model_parallel", "tensorwise", True, True),
])
def test_the_float8_all_gather_is_on_by_default_only_under_fsdp_with_tensorwise_scales(strategy, recipe, asked,
                                                                                      on) -> None:
    precision = Float8Precision(recipe, emulate=True, fsdp_float8_all_gather=asked)
    LightningLite(accelerator="cpu", devices=2, strategy=strategy, precision=precision)
    assert precision.all_gathers_in_float8 is on


def test_without_torchao_the_install_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if it were not installed
    with pytest.raises(MissingDependencyError, match=r"^FP8 precision needs the torchao package, which is not"
                                                     r" installed: run `pip install 'torchao>=0\.18'`.$"):
        Float8Precision(emulate=True)


class KnownFP8Peak(CPUAccelerator):
    supported_precisions = CPUAccelerator.supported_precisions | {"fp8-rowwise"}

    def peak_flops(self, device: torch.device, dtype: str) -> float | None:
        return {"bf16": 1e9, "fp8": 2e9}.get(dtype)


def test_the_monitor_measures_mfu_against_the_fp8_peak() -> None:
    lite = LightningLite(accelerator=KnownFP8Peak(), precision="fp8-rowwise")  # a device that declares FP8
    assert ThroughputMonitor(lite).peak_flops == 2e9
