"""Real GPU tests: marked `cuda` and skipped, with the reason, on machines without CUDA GPUs.

Run them on a GPU machine with `benchmarks/gpu_check.sh` (or `pytest -m cuda packages/lite-cuda`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import ConfigurationError
from lite_cuda import CUDAAccelerator, _nvml

SCRIPT = Path(__file__).resolve().parent / "scripts" / "gpu_train.py"
#: Float32 on GPUs: the same sums over differently split batches differ in the last bits.
TOLERANCE = 1e-5
#: NVML-based: counting at import time does not initialise CUDA in the pytest process.
GPUS = torch.cuda.device_count()


def needs_gpus(count: int) -> Callable[[Any], Any]:
    """Mark a test `cuda` and skip it, saying why, unless `count` CUDA GPUs are visible."""

    def mark(test: Any) -> Any:
        skip = pytest.mark.skipif(GPUS < count, reason=f"needs {count} CUDA GPU(s); this machine has {GPUS}")
        return pytest.mark.cuda(skip(test))

    return mark


def _bf16_native() -> bool:
    return GPUS > 0 and torch.cuda.get_device_capability(0) >= (8, 0)


def _model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    generator = torch.Generator().manual_seed(1)
    return model, torch.randn(64, 32, generator=generator), torch.randn(64, 8, generator=generator)


def _batches(x: torch.Tensor, y: torch.Tensor, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[s % 4::4], y[s % 4::4]) for s in range(steps)]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], device: torch.device,
           backward: Callable[[torch.Tensor], None]) -> list[float]:
    losses = []
    for xb, yb in batches:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(xb.to(device)).float(), yb.to(device))
        backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _trained_plainly_and_by_lite(optimizer: Callable[[Any], torch.optim.Optimizer],
                                 **lite_args: Any) -> tuple[LightningLite, nn.Module, nn.Module]:
    """The same model and 20 batches trained by plain PyTorch on GPU 0, then by
    `LightningLite(accelerator="cuda", **lite_args)`, each with `optimizer(parameters)`: the Lite
    object, the model it trained and the plain one."""
    model, x, y = _model_and_data()
    batches = _batches(x, y, 20)
    device = torch.device("cuda", 0)
    plain = model.to(device)
    _train(plain, optimizer(plain.parameters()), batches, device, lambda loss: loss.backward())

    lite = LightningLite(accelerator="cuda", **lite_args)
    model, _, _ = _model_and_data()
    wrapped, set_up_optimizer = lite.setup(model, optimizer(model.parameters()))
    _train(wrapped, set_up_optimizer, batches, lite.device, lite.backward)
    return lite, model, plain


# --- one GPU, in this process ------------------------------------------------------------------------

@needs_gpus(1)
def test_single_gpu_32_true_is_plain_pytorch_bit_for_bit() -> None:
    lite, model, plain = _trained_plainly_and_by_lite(lambda parameters: torch.optim.Adam(parameters, lr=1e-2),
                                                      devices=1)
    device = torch.device("cuda", 0)
    assert lite.device == device
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert mine.device == device
        assert torch.equal(mine, theirs)


@needs_gpus(1)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_trains_on_a_gpu(precision: str, tmp_path: Path) -> None:
    if precision == "bf16-mixed" and not _bf16_native():
        with pytest.raises(ConfigurationError, match="needs a GPU with bfloat16"):
            LightningLite(accelerator="cuda", precision=precision)
        return
    lite = LightningLite(accelerator="cuda", precision=precision)
    model, x, y = _model_and_data()
    wrapped, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    seen = {}
    # a forward hook sees the module's own output, computed under autocast, as in plain PyTorch
    wrapped.register_forward_hook(lambda m, i, out: seen.update(dtype=out.dtype))
    losses = _train(wrapped, optimizer, _batches(x, y, 40), lite.device, lite.backward)

    assert model[0].weight.dtype == torch.float32
    assert seen["dtype"] == (torch.float16 if precision == "16-mixed" else torch.bfloat16)
    assert wrapped(x[:4].to(lite.device)).dtype == torch.float32  # what the caller gets back
    assert sum(losses[-4:]) < sum(losses[:4])  # each sum covers the same four batches
    scaler = lite._plan.precision.scaler  # type: ignore[attr-defined]
    assert (scaler is not None) == (precision == "16-mixed")
    if scaler is not None:
        assert scaler.is_enabled()
        scaler.update(new_scale=123.0)
        lite.save({"model": wrapped, "optimizer": optimizer}, tmp_path / "ckpt.pt")
        other = LightningLite(accelerator="cuda", precision=precision)
        fresh, _, _ = _model_and_data()
        other.load(tmp_path / "ckpt.pt", {"model": fresh})
        assert other._plan.precision.scaler.get_scale() == 123.0  # type: ignore[attr-defined]
        assert torch.equal(fresh[0].weight, model[0].weight.cpu())


@needs_gpus(1)
@pytest.mark.parametrize(("precision", "dtype"),
                         [("16-true", torch.float16), ("bf16-true", torch.bfloat16), ("64-true", torch.float64)])
def test_true_precision_trains_on_a_gpu(precision: str, dtype: torch.dtype) -> None:
    if precision == "bf16-true" and not _bf16_native():
        pytest.skip("bf16-true needs a GPU with compute capability 8.0; its refusal is tested on CPU")
    lite = LightningLite(accelerator="cuda", precision=precision)
    model, x, y = _model_and_data()
    wrapped, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
    losses = _train(wrapped, optimizer, _batches(x, y, 40), lite.device, lite.backward)

    assert model[0].weight.dtype == dtype and model[0].weight.is_cuda
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) < sum(losses[:4])


@needs_gpus(1)
def test_matmul_precision_is_applied_in_the_process() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        lite = LightningLite(accelerator=CUDAAccelerator(matmul_precision="high"))
        lite.setup(nn.Linear(2, 2))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


@needs_gpus(1)
def test_nvml_describes_each_gpu_as_torch_does() -> None:
    for index in range(GPUS):
        facts = _nvml.visible_gpu(index)
        if facts is None:
            pytest.skip("NVML cannot describe these GPUs here (UUIDs in CUDA_VISIBLE_DEVICES or mixed models)")
        assert facts == (torch.cuda.get_device_name(index), *torch.cuda.get_device_capability(index))


# --- two GPUs in one process (dp) -----------------------------------------------------------------------

@needs_gpus(2)
def test_dp_on_two_gpus_matches_one_gpu() -> None:
    _, model, plain = _trained_plainly_and_by_lite(lambda parameters: torch.optim.SGD(parameters, lr=0.05),
                                                   strategy="dp", devices=2)
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=TOLERANCE, atol=TOLERANCE)


# --- processes (each job in a fresh interpreter) ------------------------------------------------------------

def _replay_one_process(job: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The same epochs as gpu_train.py, as a plain one-process PyTorch loop."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    model.load_state_dict(job["initial"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = job["x"].to(device), job["y"].to(device)
    world, global_batch = job["world_size"], 16
    for _ in range(3):
        for start in range(0, len(x), global_batch):
            # A DistributedSampler without shuffling deals sample i to rank i % world.
            order = [start + r + world * k for r in range(world) for k in range(global_batch // world)]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[order]), y[order]).backward()
            optimizer.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _run_job(run_script: Any, output_of: Any, tmp_path: Path, strategy: str, devices: int,
             precision: str = "32-true") -> tuple[Any, dict[str, Any]]:
    out = tmp_path / f"{strategy}.pt"
    proc = run_script(SCRIPT, strategy, devices, precision, out, timeout=180)
    assert proc.returncode == 0, output_of(proc)
    return proc, torch.load(out, weights_only=True)


@needs_gpus(1)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_ddp_fork_starts_gpu_workers_from_a_parent_that_never_initialised_cuda(
        run_script: Any, output_of: Any, tmp_path: Path, precision: str) -> None:
    devices = min(GPUS, 2)
    proc, job = _run_job(run_script, output_of, tmp_path, "ddp_fork", devices, precision)
    assert "PARENT_CUDA_INITIALISED=False" in proc.stdout, output_of(proc)
    assert "RESULT cuda:0" in proc.stdout
    assert job["devices"] == list(range(devices)) and job["ranks_agree"]
    assert job["losses"][-4] < job["losses"][0]  # the same first batch, two epochs later


@needs_gpus(2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_gpu_ddp_matches_one_process(run_script: Any, output_of: Any, tmp_path: Path, strategy: str) -> None:
    _, job = _run_job(run_script, output_of, tmp_path, strategy, 2)
    assert job["devices"] == [0, 1] and job["world_size"] == 2 and job["ranks_agree"]
    expected = _replay_one_process(job, torch.device("cuda", 0))
    for name, value in job["final"].items():
        torch.testing.assert_close(value, expected[name], rtol=TOLERANCE, atol=TOLERANCE)


@needs_gpus(1)
@pytest.mark.timeout(120)
def test_hiding_every_gpu_gives_the_sentence_naming_cuda_visible_devices(run_script: Any, output_of: Any) -> None:
    code = "from lite_core import LightningLite; LightningLite(accelerator='cuda')"
    proc = run_script(command=[*_python(), "-c", code], env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode != 0
    assert "no GPU is visible with CUDA_VISIBLE_DEVICES=''" in proc.stderr, output_of(proc)


def _python() -> list[str]:
    import sys

    return [sys.executable]


def _hopper() -> bool:
    return GPUS > 0 and torch.cuda.get_device_capability(0) >= (9, 0)


class _Experts(nn.Module):
    """Four stacked experts over `torch._grouped_mm`, 32 tokens each (the layout torchao's kernel takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 256, 128) * 0.05)
        self.w2 = nn.Parameter(torch.randn(4, 128, 256) * 0.05)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([32, 64, 96, 128], dtype=torch.int32, device=tokens.device)
        hidden = torch.relu(torch._grouped_mm(tokens, self.w1.transpose(-2, -1), offs=offs))
        return torch._grouped_mm(hidden, self.w2.transpose(-2, -1), offs=offs)


def _moe_steps(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
               backward: Callable[[torch.Tensor], None], optimizer: torch.optim.Optimizer) -> list[float]:
    generator = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        x = torch.randn(128, 128, generator=generator).cuda().to(torch.bfloat16)
        y = torch.randn(128, 128, generator=generator).cuda()
        loss = nn.functional.mse_loss(forward(x).float(), y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@needs_gpus(1)
def test_experts_in_fp8_run_torchaos_grouped_kernel_as_by_hand() -> None:
    """`Float8Precision(experts="rowwise")` on a Hopper GPU: the experts' grouped products in torchao's
    FP8 rowwise kernel, the same losses and weights as the user's own torchao conversion."""
    if not _hopper():
        pytest.skip("FP8 grouped products need compute capability 9.0; their refusal is tested on CPU")
    pytest.importorskip("torchao.prototype.moe_training", reason="needs lite-core[fp8] (torchao)")
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor
    from torchao.quantization import quantize_

    from lite_core import Float8Precision
    from lite_core.precision.fp8 import holds_stacked_experts

    lite = LightningLite(accelerator="cuda", devices=1, precision=Float8Precision(experts="rowwise",
                                                                                  autocast_dtype=None))
    torch.manual_seed(0)
    model = _Experts().to(torch.bfloat16)
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(isinstance(p.data, Float8TrainingWeightWrapperTensor) for p in model.parameters())
    losses = _moe_steps(model, model, lite.backward, optimizer)

    torch.manual_seed(0)
    plain = _Experts().to(torch.bfloat16).cuda()
    quantize_(plain, Float8TrainingOpConfig(), filter_fn=holds_stacked_experts)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    assert losses == _moe_steps(plain, plain, torch.Tensor.backward, plain_optimizer)
    for value, plain_value in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(value, plain_value)
