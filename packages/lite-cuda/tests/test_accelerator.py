"""The CUDA accelerator on a faked runtime: availability, choice, NCCL, per-process set-up, bf16."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lite_core import LightningLite
from lite_core.errors import ConfigurationError
from lite_core.precision import MixedPrecision, TruePrecision
from lite_core.strategies import DDPStrategy, SingleDeviceStrategy
from lite_cuda import CUDAAccelerator, _runtime


def one_sentence(match: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigurationError, match=match) as info:
        LightningLite(**kwargs)
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
    return message


# --- availability and the choice of accelerator ------------------------------------------------------

def test_auto_prefers_a_gpu_and_falls_back_to_the_cpu(fake_gpus: Any) -> None:
    fake = fake_gpus(2)
    lite = LightningLite()
    assert isinstance(lite.strategy.accelerator, CUDAAccelerator)
    assert lite.device == torch.device("cuda", 0)

    fake.count = 0
    assert LightningLite().strategy.accelerator.name == "cpu"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["cuda", "gpu"])
def test_cuda_and_gpu_name_the_same_accelerator(fake_gpus: Any, name: str) -> None:
    fake_gpus(1)
    lite = LightningLite(accelerator=name)
    assert type(lite.strategy.accelerator) is CUDAAccelerator
    assert lite.strategy.accelerator.name == "cuda"  # type: ignore[union-attr]


def test_the_legacy_gpus_flag_means_cuda_devices(fake_gpus: Any) -> None:
    fake_gpus(2)
    with pytest.warns(DeprecationWarning, match="gpus= is deprecated"):
        lite = LightningLite(gpus=2)
    assert isinstance(lite.strategy.accelerator, CUDAAccelerator)
    assert isinstance(lite.strategy, DDPStrategy)
    assert lite.strategy.device_indexes == [0, 1]


def test_asking_for_cuda_without_a_gpu_says_what_is_missing(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_gpus(0)
    one_sentence(r"^accelerator='cuda' was requested but no NVIDIA GPU is visible \(torch.cuda.device_count\(\) is 0:"
                 r" check the driver with nvidia-smi\): use accelerator='auto' or 'cpu'\.$", accelerator="cuda")

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    one_sentence(r"^accelerator='gpu' was requested but no GPU is visible with CUDA_VISIBLE_DEVICES=''",
                 accelerator="gpu")

    monkeypatch.setattr(_runtime, "cuda_built", lambda: False)
    one_sentence(rf"but torch {re.escape(torch.__version__)} is built without CUDA \(install a CUDA build of"
                 r" torch", accelerator="cuda")
    # An instance skips the availability check; parsing the devices still names the problem.
    one_sentence(r"^accelerator='cuda' needs a GPU but torch .* is built without CUDA",
                 accelerator=CUDAAccelerator())
    assert fake.current == []


def test_the_real_runtime_of_a_cpu_only_torch_reports_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # No fake here: on a machine without a GPU the real runtime must say so, not fail.
    if torch.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU; the check is for CPU-only machines")
    for name in _INITIALISES_CUDA:
        monkeypatch.setattr(torch.cuda, name, _forbidden(name))
    assert CUDAAccelerator.is_available() is False
    assert _runtime.device_count() == 0
    assert _runtime.gpu(0) is None


# --- processes: NCCL, the device of each rank ----------------------------------------------------------

def _no_store_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's store in this process's memory: no rank 0 serves MASTER_PORT here, and a client
    of a real TCPStore would wait for it (Lite builds the group on a per-attempt store)."""
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: dist.HashStore())


def test_several_gpus_run_ddp_over_nccl(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_gpus(4)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    _no_store_server(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")  # as if started by Lite's launcher for rank 1
    monkeypatch.setenv("MASTER_PORT", "29555")

    lite = LightningLite(accelerator="cuda", devices=[1, 3])
    assert isinstance(lite.strategy, DDPStrategy)
    lite.strategy.setup_environment()

    assert seen["backend"] == "nccl"
    assert (seen["rank"], seen["world_size"]) == (1, 2)
    assert lite.device == torch.device("cuda", 3)
    assert fake.current == [torch.device("cuda", 3)]


def test_the_process_group_backend_can_still_be_overridden(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(2)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    _no_store_server(monkeypatch)
    monkeypatch.setenv("MASTER_PORT", "29556")
    lite = LightningLite(accelerator="cuda", strategy=DDPStrategy(process_group_backend="gloo"), devices=2)
    lite.strategy.setup_environment()
    assert seen["backend"] == "gloo"


def test_one_gpu_makes_its_device_current_once(fake_gpus: Any) -> None:
    fake = fake_gpus(2)
    lite = LightningLite(accelerator="cuda", devices=[1])
    assert isinstance(lite.strategy, SingleDeviceStrategy)
    assert fake.current == []  # construction touches no GPU

    lite.strategy.setup_environment()
    lite.strategy.setup_environment()
    assert fake.current == [torch.device("cuda", 1)]


# --- TF32 --------------------------------------------------------------------------------------------

def test_tf32_is_left_alone_unless_asked_for(fake_gpus: Any) -> None:
    fake_gpus(1)
    before = torch.get_float32_matmul_precision()
    try:
        LightningLite(accelerator="cuda").strategy.setup_environment()
        assert torch.get_float32_matmul_precision() == before

        other = "medium" if before != "medium" else "high"
        LightningLite(accelerator=CUDAAccelerator(matmul_precision=other)).strategy.setup_environment()
        assert torch.get_float32_matmul_precision() == other
    finally:
        torch.set_float32_matmul_precision(before)


def test_an_unknown_matmul_precision_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"^matmul_precision='tf32' is not valid: pass one of"):
        CUDAAccelerator(matmul_precision="tf32")


# --- precision ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("precision", "kind", "dtype"),
    [("16-mixed", MixedPrecision, torch.float16), ("bf16-mixed", MixedPrecision, torch.bfloat16),
     ("16-true", TruePrecision, torch.float16), ("bf16-true", TruePrecision, torch.bfloat16),
     ("64-true", TruePrecision, torch.float64)],
)
def test_every_precision_is_offered_on_cuda(fake_gpus: Any, precision: str, kind: type, dtype: torch.dtype) -> None:
    fake_gpus(1)
    built = LightningLite(accelerator="cuda", precision=precision)._plan.precision
    assert type(built) is kind and built._dtype == dtype  # type: ignore[attr-defined]
    if kind is MixedPrecision:
        assert built._device_type == "cuda"  # type: ignore[attr-defined]


def test_16_mixed_has_a_cuda_grad_scaler(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(1)
    precision = LightningLite(accelerator="cuda", precision="16-mixed")._plan.precision
    # Only a CUDA build of torch enables a CUDA scaler; here its device type is what matters.
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    assert isinstance(precision, MixedPrecision)
    assert precision.scaler is not None and precision.scaler._device == "cuda"
    assert precision.scaler.is_enabled()


def test_the_cuda_grad_scaler_state_travels_with_checkpoints(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Any) -> None:
    fake_gpus(1)
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    lite = LightningLite(accelerator="cuda", precision="16-mixed")
    scaler = lite._plan.precision.scaler  # type: ignore[attr-defined]
    scaler.load_state_dict({**scaler.state_dict(), "scale": 123.0, "_growth_tracker": 7})
    lite.save({"step": 5}, tmp_path / "ckpt.pt")

    other = LightningLite(accelerator="cuda", precision="16-mixed")
    state = {"step": 0}
    other.load(tmp_path / "ckpt.pt", state)

    restored = other._plan.precision.scaler  # type: ignore[attr-defined]
    assert restored._device == "cuda"
    assert (restored.get_scale(), restored.state_dict()["_growth_tracker"], state["step"]) == (123.0, 7, 5)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_a_gpu_without_it_fails_at_construction(fake_gpus: Any, precision: str) -> None:
    fake_gpus(2, name="Tesla V100-SXM2-16GB", capability=(7, 0))
    fallback = precision.replace("bf16", "16")
    one_sentence(rf"^precision='{precision}' needs a GPU with bfloat16 \(compute capability 8.0 or newer, e.g."
                 rf" A100, H100, RTX 30xx\) but GPU 0 is Tesla V100-SXM2-16GB \(7.0\): use"
                 rf" precision='{fallback}'\.$", accelerator="cuda", devices=2, precision=precision)
    LightningLite(accelerator="cuda", devices=2, precision="16-mixed")


def test_bf16_on_a_gpu_nvml_cannot_describe_is_checked_in_the_training_process(fake_gpus: Any) -> None:
    fake = fake_gpus(1, name="Tesla T4", capability=(7, 5), described=False)
    lite = LightningLite(accelerator="cuda", precision="bf16-mixed")

    with pytest.raises(ConfigurationError, match=r"but GPU 0 is Tesla T4 \(7.5\): use precision='16-mixed'"):
        lite.strategy.setup_environment()
    assert fake.current == [torch.device("cuda", 0)]


def test_bf16_on_an_ampere_gpu_is_accepted_at_construction_and_in_the_process(fake_gpus: Any) -> None:
    fake_gpus(1, capability=(8, 6), described=False)
    lite = LightningLite(accelerator="cuda", precision="bf16-true")
    lite.strategy.setup_environment()
    assert lite._plan.precision.name == "bf16-true"


@pytest.mark.parametrize("precision", ["fp8-rowwise", "fp8-tensorwise"])
def test_fp8_below_compute_capability_8_9_fails_at_construction_and_names_emulation(fake_gpus: Any,
                                                                                    precision: str) -> None:
    pytest.importorskip("torchao", reason="needs lite-core[fp8] (torchao), which test-cuda installs")
    fake_gpus(2, name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
    recipe = precision.removeprefix("fp8-")
    one_sentence(rf"^precision='{precision}' needs a GPU with FP8 \(compute capability 8.9 or newer, e.g. L4, H100\)"
                 rf" but GPU 0 is NVIDIA A100-SXM4-80GB \(8.0\): use precision='bf16-mixed', or emulate FP8 for"
                 rf" tests with precision=Float8Precision\('{recipe}', emulate=True\)\.$",
                 accelerator="cuda", devices=2, precision=precision)


def test_fp8_on_a_hopper_gpu_is_accepted(fake_gpus: Any) -> None:
    pytest.importorskip("torchao", reason="needs lite-core[fp8] (torchao), which test-cuda installs")
    fake_gpus(1, name="NVIDIA H100 80GB HBM3", capability=(9, 0))
    assert LightningLite(accelerator="cuda", precision="fp8-rowwise")._plan.precision.name == "fp8-rowwise"


@pytest.mark.parametrize(("experts", "gpu", "capability", "refusal"), [
    ("rowwise", "NVIDIA L4", (8, 9), r"^Float8Precision\(experts='rowwise'\) needs a GPU with FP8 grouped matrix"
     r" products \(compute capability 9.0 or newer, e.g. H100, H200\) but GPU 0 is NVIDIA L4 \(8.9\): use bf16"
     r" grouped products \(leave experts out\)\.$"),
    ("mxfp8", "NVIDIA H100 80GB HBM3", (9, 0), r"^Float8Precision\(experts='mxfp8'\) needs a GPU with MXFP8 grouped"
     r" matrix products \(compute capability 10.0 or newer, e.g. B200, GB200\) but GPU 0 is NVIDIA H100 80GB HBM3"
     r" \(9.0\): use experts='rowwise' \(compute capability 9.0\), or leave experts out\.$"),
])
def test_experts_in_low_precision_below_their_gpu_generation_fail_at_construction(
        fake_gpus: Any, experts: str, gpu: str, capability: tuple[int, int], refusal: str) -> None:
    pytest.importorskip("torchao.prototype.moe_training", reason="needs lite-core[fp8] (torchao), which test-cuda installs")
    from lite_core import Float8Precision

    fake = fake_gpus(2, name=gpu, capability=capability)
    one_sentence(refusal, accelerator="cuda", devices=2, precision=Float8Precision(experts=experts))
    fake.gpu = _runtime.GPU("NVIDIA B200", (10, 0))
    lite = LightningLite(accelerator="cuda", devices=2, precision=Float8Precision(experts=experts))
    assert lite._plan.precision.experts == experts


def test_a_hardware_feature_every_gpu_declares_passes_the_per_gpu_check(fake_gpus: Any) -> None:
    # `validate_hardware` checks compute capability for the grouped products only; another declared
    # feature ("fp8", whose capability its precision's row checks) used to raise a KeyError there.
    fake_gpus(1, name="NVIDIA H100 80GB HBM3", capability=(9, 0))
    precision = TruePrecision("32-true", torch.float32)
    precision.hardware_features = {"fp8": "a toy precision"}
    assert LightningLite(accelerator="cuda", precision=precision)._plan.precision is precision


# --- never initialise CUDA in the parent -----------------------------------------------------------------

_INITIALISES_CUDA = ("is_available", "init", "_lazy_init", "current_device", "get_device_properties",
                     "get_device_capability", "get_device_name", "set_device", "is_bf16_supported")


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_spawn", "ddp", "dp"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_constructing_lite_never_initialises_cuda(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch,
                                                   strategy: str, precision: str) -> None:
    fake_gpus(2, described=False)
    for name in _INITIALISES_CUDA:
        monkeypatch.setattr(torch.cuda, name, _forbidden(name))
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", _forbidden("_cuda_getDeviceCount"), raising=False)

    lite = LightningLite(accelerator="cuda", strategy=strategy, devices=2, precision=precision)
    assert lite.strategy.name == strategy


def _forbidden(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"torch.cuda.{name}() initialises CUDA in the parent process")

    return call


def test_spawned_workers_receive_the_tf32_choice_and_the_pending_bf16_check(fake_gpus: Any) -> None:
    # ddp_spawn pickles the strategy (with its accelerator) into every worker.
    import pickle

    fake_gpus(2, described=False)
    lite = LightningLite(accelerator=CUDAAccelerator(matmul_precision="medium"), strategy="ddp_spawn", devices=2,
                         precision="bf16-mixed")
    copy = pickle.loads(pickle.dumps(lite._plan))  # the plan: the strategy, and the precision beside it

    assert copy.strategy.accelerator.matmul_precision == "medium"
    assert copy.strategy.accelerator._unchecked_bf16 == "bf16-mixed"
    assert copy.precision.name == "bf16-mixed"
