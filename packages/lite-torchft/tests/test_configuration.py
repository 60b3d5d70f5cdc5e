"""A replica group that is not told which group it is, or where the lighthouse is, fails in one sentence."""

from __future__ import annotations

from datetime import timedelta

import pytest

from conftest import free_port  # the repository's conftest.py
from lite_core import LightningLite
from lite_core.plugins import ConfigurationError
from lite_torchft import DDPFTStrategy
from lite_torchft.fsdp import FSDPFTStrategy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def group_variables(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> pytest.MonkeyPatch:
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    return monkeypatch


@pytest.mark.parametrize("missing", ["REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"])
def test_a_missing_variable_fails_at_construction_naming_it(group_variables: pytest.MonkeyPatch, missing: str) -> None:
    group_variables.delenv(missing)
    with pytest.raises(ConfigurationError, match=f"needs {missing} set: start each replica group with"):
        LightningLite(accelerator="cpu", strategy="ddp_ft")


def test_a_group_id_outside_the_groups_is_refused(group_variables: pytest.MonkeyPatch) -> None:
    group_variables.setenv("REPLICA_GROUP_ID", "2")
    with pytest.raises(ConfigurationError, match=r"REPLICA_GROUP_ID=2 is outside 0..1"):
        LightningLite(accelerator="cpu", strategy=DDPFTStrategy())


def test_no_lighthouse_at_the_address_names_the_command_that_starts_one(group_variables: pytest.MonkeyPatch) -> None:
    lite = LightningLite(accelerator="cpu", strategy=FSDPFTStrategy(connect_timeout=2))
    with pytest.raises(ConfigurationError, match="No torchft lighthouse answers at .* start one with `torchft_lighthouse"):
        lite.launch(lambda lite: None)


def test_names_resolve_through_the_entry_points(group_variables: pytest.MonkeyPatch) -> None:
    assert type(LightningLite(accelerator="cpu", strategy="ddp_ft").strategy) is DDPFTStrategy
    assert type(LightningLite(accelerator="cpu", strategy="fsdp_ft").strategy) is FSDPFTStrategy


def test_the_strategy_wide_split_batches_is_deprecated_for_the_core_flag() -> None:
    with pytest.warns(FutureWarning, match=r"DDPFTStrategy\(split_batches=True\) is deprecated: pass setup_data"):
        DDPFTStrategy(split_batches=True)


class _RecordedNCCL:
    """Stands in for torchft's `ProcessGroupNCCL`, which asks the CUDA build of torch for NCCL's version."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout


class _CUDADeclaration:
    """What lite-cuda's accelerator declares for the process group (lite-cuda is not installed here)."""

    distributed_backend = "nccl"


def test_groups_meet_over_nccl_where_the_group_does_and_over_gloo_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step all-reduce between groups runs on the backend of the group's own process group:
    NCCL where the accelerator declares it (CUDA gradients stay on the GPUs, as torchft's own
    examples choose), gloo on CPUs and where the user asked the group for gloo."""
    import torchft

    from lite_core.accelerators.cpu import CPUAccelerator

    on_cpu = DDPFTStrategy(ft_timeout=7)
    on_cpu.accelerator = CPUAccelerator()
    across = on_cpu._across_groups()
    assert type(across) is torchft.ProcessGroupGloo and across._timeout == timedelta(seconds=7)
    monkeypatch.setattr(torchft, "ProcessGroupNCCL", _RecordedNCCL)
    for strategy in (DDPFTStrategy(ft_timeout=7), FSDPFTStrategy(ft_timeout=7)):
        strategy.accelerator = _CUDADeclaration()
        across = strategy._across_groups()
        assert type(across) is _RecordedNCCL and across.timeout == timedelta(seconds=7)
    gloo_asked = DDPFTStrategy(ft_timeout=7, process_group_backend="gloo")
    gloo_asked.accelerator = _CUDADeclaration()
    assert type(gloo_asked._across_groups()) is torchft.ProcessGroupGloo


@pytest.mark.parametrize("strategy", ["DiLoCoStrategy", "DiLoCoFSDPStrategy"])
def test_quantized_diloco_on_a_cpu_is_refused_at_construction(group_variables: pytest.MonkeyPatch,
                                                              strategy: str) -> None:
    """torchft all-reduces unquantized, silently, where its Triton kernels cannot run."""
    from lite_torchft import diloco

    with pytest.raises(ConfigurationError, match=rf"{strategy}\(should_quantize=True\) .* CUDA GPUs only") as info:
        LightningLite(accelerator="cpu", strategy=getattr(diloco, strategy)(sync_every=2, should_quantize=True))
    assert str(info.value).endswith(".") and ". " not in str(info.value)
    assert LightningLite(accelerator="cpu", strategy=getattr(diloco, strategy)(sync_every=2)) is not None
