"""Every precision trains on CPU and types modules, inputs and outputs as it promises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import MisuseError
from lite_core.precision import MixedPrecision

_EXPECTED_DTYPES = {
    "64-true": (torch.float64, torch.float64),
    "32-true": (torch.float32, torch.float32),
    "16-true": (torch.float16, torch.float16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.float32),
}


@pytest.mark.parametrize("precision", sorted(_EXPECTED_DTYPES))
def test_each_precision_trains(precision: str) -> None:
    torch.manual_seed(0)
    lite = LightningLite(accelerator="cpu", precision=precision)
    model = lite.setup(nn.Linear(4, 1))
    optimizer = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    param_dtype, output_dtype = _EXPECTED_DTYPES[precision]
    assert model.weight.dtype == param_dtype
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        output = model(x)
        assert output.dtype == output_dtype
        loss = nn.functional.mse_loss(output.float(), y)
        lite.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_mixed_precision_runs_forward_under_autocast() -> None:
    lite = LightningLite(accelerator="cpu", precision="bf16-mixed")
    seen = {}

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            return x

    lite.setup(Probe())(torch.ones(1))
    assert seen["autocast"] is True
    with lite.autocast():
        assert torch.is_autocast_enabled("cpu")


def test_16_mixed_uses_a_grad_scaler_saved_in_checkpoints(tmp_path) -> None:
    lite = LightningLite(accelerator="cpu", precision="16-mixed")
    precision = lite.strategy.precision
    assert isinstance(precision, MixedPrecision) and precision.scaler is not None
    model = lite.setup(nn.Linear(2, 1))
    optimizer = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    lite.backward(model(torch.ones(2, 2)).sum())
    optimizer.step()
    precision.scaler.update(new_scale=123.0)
    lite.save({"model": model}, tmp_path / "ckpt.pt")
    other = LightningLite(accelerator="cpu", precision="16-mixed")
    assert other.strategy.precision.scaler.get_scale() != 123.0
    content = other.load(tmp_path / "ckpt.pt", {"model": nn.Linear(2, 1)})
    assert other.strategy.precision.scaler.get_scale() == 123.0
    assert "lite_precision" not in content


def test_16_mixed_refuses_a_closure() -> None:
    lite = LightningLite(accelerator="cpu", precision="16-mixed")
    model = nn.Linear(2, 1)
    model, optimizer = lite.setup(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(MisuseError, match="closure"):
        optimizer.step(lambda: model(torch.ones(1, 2)).sum())


def test_true_precision_casts_inputs() -> None:
    lite = LightningLite(accelerator="cpu", precision="64-true")
    model = lite.setup(nn.Linear(2, 1))
    assert model(torch.ones(3, 2, dtype=torch.float32)).dtype == torch.float64


def test_the_grad_scaler_is_built_in_the_process_that_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    # Building a CUDA scaler asks torch.cuda.is_available(), which initialises CUDA: a parent that
    # later forks its ranks (ddp_fork) must not do that while it only constructs Lite.
    built = []
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *args, **kwargs: built.append(args) or real(*args, **kwargs))

    lite = LightningLite(accelerator="cpu", precision="16-mixed")
    assert built == []

    module = nn.Linear(2, 1)
    model, optimizer = lite.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    lite.backward(model(torch.ones(1, 2)).sum())
    assert built == [("cpu",)]
    assert lite.strategy.precision.scaler is lite.strategy.precision.scaler
