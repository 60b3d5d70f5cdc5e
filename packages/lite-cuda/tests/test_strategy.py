"""`strategy="dp"`: one process, several GPUs, the precision applied inside each replica."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import ConfigurationError, UnknownNameError
from lite_core.precision import MixedPrecision
from lite_cuda import DataParallelStrategy
from lite_cuda import strategy as dp_module


def test_dp_drives_several_gpus_from_one_process(fake_gpus: Any) -> None:
    fake = fake_gpus(4)
    lite = LightningLite(accelerator="cuda", strategy="dp", devices=[2, 3])

    assert isinstance(lite.strategy, DataParallelStrategy)
    assert lite.strategy.launcher is None
    assert (lite.world_size, lite.global_rank) == (1, 0)
    assert lite.device == torch.device("cuda", 2)
    assert lite.strategy.distributed_sampler_kwargs() is None
    lite.strategy.setup_environment()
    assert fake.current == [torch.device("cuda", 2)]


def test_dp_runs_only_on_gpus_and_on_one_node(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match=r"^strategy='dp' does not run on accelerator='cpu': choose one of"
                                                 r" \['cuda'\] or another strategy\.$"):
        LightningLite(accelerator="cpu", strategy="dp", devices=2)

    fake_gpus(2)
    for name, value in (("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500"), ("NODE_RANK", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=r"^strategy='dp' runs one process but devices=2, num_nodes=2"):
        LightningLite(accelerator="cuda", strategy="dp", devices=2, num_nodes=2)


def test_auto_accelerator_for_dp_is_cuda(fake_gpus: Any) -> None:
    fake_gpus(2)
    assert LightningLite(strategy="dp", devices=2).strategy.accelerator.name == "cuda"  # type: ignore[union-attr]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, dict[str, Any]]] = []

    def __call__(self, module: nn.Module, **kwargs: Any) -> nn.Module:
        self.calls.append((module, kwargs))
        return module


@pytest.mark.parametrize(("precision", "wrapped"), [("32-true", False), ("16-mixed", True), ("bf16-true", True)])
def test_dp_wraps_the_module_for_the_chosen_gpus(fake_gpus: Any, monkeypatch: pytest.MonkeyPatch,
                                                 precision: str, wrapped: bool) -> None:
    # torch.nn.DataParallel needs real GPUs; record what Lite asks of it instead.
    fake_gpus(4)
    recorder = _Recorder()
    monkeypatch.setattr(dp_module, "DataParallel", recorder)
    lite = LightningLite(accelerator="cuda", strategy="dp", devices=[1, 3], precision=precision)
    model = nn.Linear(2, 2)

    lite.strategy.setup_module(model, precision=lite._plan.precision)

    [(module, kwargs)] = recorder.calls
    assert kwargs == {"device_ids": [torch.device("cuda", 1), torch.device("cuda", 3)],
                      "output_device": torch.device("cuda", 1)}
    assert (module is not model) == wrapped
    if wrapped:
        assert module.module is model  # type: ignore[union-attr]
        assert list(module.state_dict()) == ["module.weight", "module.bias"]


def test_each_replica_thread_runs_under_the_precision() -> None:
    # DataParallel calls replicas from worker threads, where the caller's autocast dtype is unset.
    precision = MixedPrecision("bf16-mixed", "cpu")
    seen: dict[str, Any] = {}

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            return nn.functional.linear(x, torch.ones(2, 2))

    replica = dp_module._InPrecision(Probe(), precision)
    thread = threading.Thread(target=lambda: seen.update(dtype=replica(torch.ones(1, 2)).dtype))
    thread.start()
    thread.join()

    assert seen == {"autocast": True, "dtype": torch.bfloat16}


def test_a_misspelt_ddp_is_not_taken_for_dp() -> None:
    # With lite-cuda installed "dp" is a valid name too; "dpp" is one wrong letter from "ddp".
    with pytest.raises(UnknownNameError, match="did you mean 'ddp'\\?"):
        LightningLite(strategy="dpp")


@pytest.mark.parametrize("precision", ["nf4", "int8"])
def test_dp_refuses_quantized_weights_before_anything_runs(fake_gpus: Any, precision: str) -> None:
    # DataParallel's replicate copies the weights as plain tensors, without bitsandbytes' state.
    fake_gpus(2)
    with pytest.raises(ConfigurationError, match=rf"precision='{precision}'.*strategy='dp'|strategy='dp'.*'{precision}'"):
        LightningLite(accelerator="cuda", strategy="dp", devices=2, precision=precision)
