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
    precision = lite._plan.precision
    assert isinstance(precision, MixedPrecision) and precision.scaler is not None
    model = lite.setup(nn.Linear(2, 1))
    optimizer = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    lite.backward(model(torch.ones(2, 2)).sum())
    optimizer.step()
    precision.scaler.update(new_scale=123.0)
    lite.save({"model": model}, tmp_path / "ckpt.pt")
    other = LightningLite(accelerator="cpu", precision="16-mixed")
    assert other._plan.precision.scaler.get_scale() != 123.0
    content = other.load(tmp_path / "ckpt.pt", {"model": nn.Linear(2, 1)})
    assert other._plan.precision.scaler.get_scale() == 123.0
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
    real = torch.amp.GradScaler.__init__
    monkeypatch.setattr(torch.amp.GradScaler, "__init__",
                        lambda self, *args, **kwargs: built.append(args) or real(self, *args, **kwargs))

    lite = LightningLite(accelerator="cpu", precision="16-mixed")
    assert built == []

    module = nn.Linear(2, 1)
    model, optimizer = lite.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    lite.backward(model(torch.ones(1, 2)).sum())
    assert built == [("cpu",)]
    assert lite._plan.precision.scaler is lite._plan.precision.scaler


# -- 16-mixed with a gradient scaler: torch's AMP recipe, one scale update per iteration ----------
def _two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _amp_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)


def _torch_amp_recipe(steps: int) -> tuple[dict[str, torch.Tensor], float]:
    """Plain torch: scale the loss, unscale and clip each optimizer, step each, update once."""
    model = _two_layers()
    optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.5), torch.optim.SGD(model[2].parameters(), lr=0.5)]
    scaler = torch.amp.GradScaler("cpu")
    x, y = _amp_data()
    for _ in range(steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output = model(x)
        scaler.scale(nn.functional.mse_loss(output.float(), y)).backward()
        for optimizer in optimizers:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 0.05)
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
    return model.state_dict(), scaler.get_scale()


def test_16_mixed_with_two_optimizers_equals_torchs_amp_recipe() -> None:
    lite = LightningLite(accelerator="cpu", precision="16-mixed")
    model = _two_layers()
    model, first, second = lite.setup(model, torch.optim.SGD(model[0].parameters(), lr=0.5),
                                      torch.optim.SGD(model[2].parameters(), lr=0.5))
    x, y = _amp_data()
    for _ in range(3):
        first.zero_grad()
        second.zero_grad()
        lite.backward(nn.functional.mse_loss(model(x), y))
        norms = [lite.clip_gradients(model, optimizer, max_norm=0.05) for optimizer in (first, second)]
        first.step()
        second.step()
    assert all(norm > 0.05 for norm in norms), "clipping never happened; the comparison would prove nothing"
    expected, expected_scale = _torch_amp_recipe(steps=3)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert lite._plan.precision.state_dict()["scaler"]["scale"] == expected_scale


def test_16_mixed_clipping_an_overflowing_step_skips_it_and_lowers_the_scale(tmp_path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # float16 gradients overflow
    lite = LightningLite(accelerator="cpu", plugins=MixedPrecision("16-mixed", "cpu", scaler=scaler))
    model = _two_layers()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _amp_data()
    lite.backward(nn.functional.mse_loss(model(x), y))
    norm = lite.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    assert not torch.isfinite(norm)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed in a step that overflowed"
    lite.save({"model": model}, tmp_path / "ckpt.pt")  # the scale update is due: saving runs it
    resumed = LightningLite(accelerator="cpu", precision="16-mixed")
    resumed.load(tmp_path / "ckpt.pt", {"model": _two_layers()})
    assert resumed._plan.precision.scaler.get_scale() == 2.0**99


def test_32_true_clipping_non_finite_gradients_still_raises() -> None:
    lite = LightningLite(accelerator="cpu")
    model = nn.Linear(2, 1)
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    lite.backward(model(torch.tensor([[float("inf"), 1.0]])).sum())
    with pytest.raises(RuntimeError, match="non-finite"):
        lite.clip_gradients(model, optimizer, max_norm=1.0)
