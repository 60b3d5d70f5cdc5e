"""`Float8Precision(experts=...)`: a Mixture of Experts' grouped matrix products through torchao's
MoE training, on one process. torchao's kernels for them (`_scaled_grouped_mm`, MXFP8) exist only
on Hopper and Blackwell GPUs, so here the kernel is replaced by a stand-in that counts its calls,
and the CPU is told it has the hardware; what is under test is Lite's part: which parameters torchao
wraps, that the products reach its kernel as when the user calls torchao by hand, that checkpoints
hold plain tensors, and the refusals. On a GPU, packages/lite-cuda/tests/test_gpu.py runs the real
kernel."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from torch import nn

from lite_core import Float8Precision, LightningLite
from lite_core.accelerators.cpu import CPUAccelerator
from lite_core.errors import ConfigurationError
from lite_core.precision.fp8 import default_module_filter, holds_stacked_experts
from lite_core.precision.names import PrecisionSupport

pytest.importorskip("torchao.prototype.moe_training", reason="needs lite-core[fp8] (torchao), which the test"
                                                             " environment installs")

EXPERTS, HIDDEN, FFN = 4, 16, 32
OFFSETS = (8, 16, 24, 32)  # tokens of experts 0..3 in a batch of 32, sorted by expert


class Experts(nn.Module):
    """Stacked experts computed with `torch._grouped_mm`, as `ExpertParallel`'s contract has them."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) * 0.2)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor(OFFSETS, dtype=torch.int32)
        hidden = torch.relu(torch._grouped_mm(tokens, self.w1.transpose(-2, -1), offs=offs))
        return torch._grouped_mm(hidden, self.w2.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.experts = Experts()
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.experts(self.inp(x).to(torch.bfloat16)))


@pytest.fixture
def grouped_kernel(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torchao's quantized grouped product replaced by bf16 `_grouped_mm` that records its config,
    and the CPU declared to have FP8 grouped products (neither exists on this machine)."""
    import torchao.prototype.moe_training.tensor as wrappers

    calls: list[str] = []

    def stand_in(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, config, bias=None) -> torch.Tensor:
        assert type(B_t) is torch.Tensor  # torchao hands its kernel the plain weight
        calls.append(type(config).__name__)
        return torch._grouped_mm(A.to(torch.bfloat16), B_t.to(torch.bfloat16), offs=offs)

    monkeypatch.setattr(wrappers, "_quantize_then_scaled_grouped_mm", stand_in)
    monkeypatch.setattr(CPUAccelerator, "precision_support", PrecisionSupport(hardware=frozenset({"fp8-grouped-mm"})))
    return calls


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(32, HIDDEN, generator=generator), torch.randn(32, 1, generator=generator)) for _ in range(3)]


def by_hand() -> tuple[list[float], nn.Module]:
    """The loop a user writes with torchao alone: Linear layers to float8 (emulated), the experts'
    parameters to torchao's MoE training wrappers, bf16 autocast around the forward."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    model = MoE()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=default_module_filter(model))
    quantize_(model, Float8TrainingOpConfig(), filter_fn=holds_stacked_experts)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_the_experts_products_reach_torchaos_kernel_as_by_hand_and_checkpoints_hold_plain_weights(
        grouped_kernel: list[str], tmp_path) -> None:
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    lite = LightningLite(accelerator="cpu", precision=Float8Precision(emulate=True, experts="rowwise"))
    torch.manual_seed(0)
    model = MoE()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped = {name for name, p in model.named_parameters() if isinstance(p.data, Float8TrainingWeightWrapperTensor)}
    assert wrapped == {"experts.w1", "experts.w2"}  # the stacked experts alone, still the user's parameters
    losses = []
    for x, y in batches():
        loss = nn.functional.mse_loss(model(x), y)
        lite.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert grouped_kernel == ["Float8TrainingOpConfig"] * 6  # 2 products x 3 steps, forward
    grouped_kernel.clear()
    plain_losses, plain = by_hand()
    assert grouped_kernel == ["Float8TrainingOpConfig"] * 6
    assert losses == plain_losses
    for (name, value), (plain_name, plain_value) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert name == plain_name and torch.equal(value, plain_value), name

    lite.save({"model": model, "optimizer": optimizer}, tmp_path / "moe.pt")
    saved = torch.load(tmp_path / "moe.pt", weights_only=True)  # a process without torchao reads it
    assert type(saved["model"]["experts.w1"]) is torch.Tensor
    assert type(lite.full_state_dict(model)["experts.w2"]) is torch.Tensor
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)  # what Lite avoids: the wrapper pickled
    buffer.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(("experts", "feature"), [("rowwise", "fp8-grouped-mm"), ("mxfp8", "mxfp8")])
def test_experts_in_low_precision_are_refused_where_the_devices_lack_the_grouped_products(experts, feature) -> None:
    # No emulation covers them: emulate=True (which lets the Linear layers run on the CPU) does not.
    with pytest.raises(ConfigurationError, match=(
            rf"^Float8Precision\(experts='{experts}'\) needs {feature} hardware, which accelerator='cpu' does not"
            r" have: choose an accelerator whose devices have it, or leave that option out.$")):
        LightningLite(accelerator="cpu", precision=Float8Precision(emulate=True, experts=experts))


def test_only_modules_of_stacked_experts_are_chosen_by_default() -> None:
    assert holds_stacked_experts(Experts(), "experts")
    assert not holds_stacked_experts(nn.Conv2d(3, 8, 3), "conv")  # a 4-D weight, not experts
    assert not holds_stacked_experts(nn.Linear(4, 4), "linear") and not holds_stacked_experts(MoE(), "")


def test_an_unknown_experts_recipe_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=(
            r"^Float8Precision\(experts='fp4'\) is not a recipe of the experts' grouped products: pass one of"
            r" \['rowwise', 'mxfp8'\], or None.$")):
        Float8Precision(emulate=True, experts="fp4")
