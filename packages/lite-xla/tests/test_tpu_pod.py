"""What only a TPU (pod) runs, checked on XLA's CPU device: the pod's topology from the TPU
environment, each host's result and checkpoint, and torch-xla's defaults in every collective.

A real pod (hosts joined by the TPU runtime, one process per chip) cannot run here: the hosts are
simulated through the variables torch-xla reads (`TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`) and
through the runtime's answers (`local_ordinal`, `global_ordinal`) in the replica functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lite_core import LightningLite
from lite_core.errors import ConfigurationError
from lite_xla import launcher
from lite_xla.strategies.xla import XLAStrategy

SRC = Path(__file__).resolve().parents[1] / "src" / "lite_xla"


@pytest.fixture
def second_host_of_a_pod(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    """This process runs on host 1 of a 2-host TPU pod with 4 devices per host (no MASTER_ADDR)."""
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setattr("lite_xla.accelerator._tpu_device_count", lambda: 4)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0,host-1")
    monkeypatch.setenv("TPU_WORKER_ID", "1")


@pytest.mark.usefixtures("second_host_of_a_pod")
def test_num_nodes_on_a_tpu_pod_takes_the_topology_from_the_tpu_runtime() -> None:
    lite = LightningLite(accelerator="tpu", devices=4, num_nodes=2)
    assert (lite.strategy.name, lite.world_size, lite.node_rank) == ("xla", 8, 1)


@pytest.mark.usefixtures("second_host_of_a_pod")
def test_num_nodes_other_than_the_pods_host_count_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"^num_nodes=3 but this TPU pod has 2 host\(s\): pass num_nodes=2,"):
        LightningLite(accelerator="tpu", devices=4, num_nodes=3)


def test_num_nodes_on_xlas_cpu_device_is_refused(clean_env: None) -> None:
    with pytest.raises(ConfigurationError, match=r"^num_nodes=2 runs XLA on the hosts of a TPU pod, but PJRT_DEVICE=CPU"):
        LightningLite(accelerator="tpu", devices=2, num_nodes=2)


@pytest.mark.parametrize(("local", "returns"), [(0, True), (1, False)])
def test_the_first_replica_of_every_host_hands_its_host_the_result(monkeypatch: pytest.MonkeyPatch,
                                                                    local: int, returns: bool) -> None:
    import torch_xla.runtime as xr

    seen: dict[str, Any] = {}
    monkeypatch.setattr(launcher, "run_rank", lambda *args, **kwargs: seen.update(kwargs))
    launcher._replica(4 + local, print, (), {}, "result.pkl", 1)  # host 1 of a pod of 4-device hosts
    monkeypatch.setattr(xr, "global_ordinal", lambda: 4 + local)
    monkeypatch.setattr(xr, "local_ordinal", lambda: local)
    assert seen["returns_result"]() is returns


class _OnSecondHost(XLAStrategy):
    """Replica `local_rank` of host 1 (global rank 4 + local_rank) of a 2-host pod."""

    def __init__(self, local_rank: int) -> None:
        super().__init__()
        self._local = local_rank

    @property
    def local_rank(self) -> int:
        return self._local

    @property
    def global_rank(self) -> int:
        return 4 + self._local

    def barrier(self, name: str | None = None) -> None:
        pass


@pytest.mark.parametrize(("local", "writes"), [(0, True), (1, False)])
def test_each_host_writes_the_checkpoint_it_will_load(tmp_path: Path, local: int, writes: bool) -> None:
    lite = LightningLite(accelerator="tpu", strategy=_OnSecondHost(local), devices=2)
    lite.strategy.save_checkpoint(str(tmp_path / "ckpt.pt"), {"step": torch.tensor([3.0])},
                                  checkpoint_io=lite._plan.checkpoint_io, precision=lite._plan.precision)
    assert (tmp_path / "ckpt.pt").exists() is writes


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, name: str, result: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, kwargs))
            return result(*args)
        return record


def test_without_the_cpu_harness_every_collective_gets_torch_xlas_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.fsdp as xla_fsdp
    import torch_xla.runtime as xr

    record = _Recorder()
    monkeypatch.setattr(xm, "all_reduce", record("all_reduce", lambda op, data: data))
    monkeypatch.setattr(xm, "all_gather", record("all_gather", lambda data: data))
    monkeypatch.setattr(xm, "reduce_gradients", record("reduce_gradients", lambda optimizer: None))
    monkeypatch.setattr(xla_fsdp, "XlaFullyShardedDataParallel", record("fsdp", lambda module: module))
    monkeypatch.setattr(xr, "world_size", lambda: 2)
    for name in ("xla", "xla_fsdp"):
        lite = LightningLite(accelerator="tpu", strategy=name, devices=2)
        strategy = lite.strategy
        strategy._environment_ready = True  # as inside a replica
        strategy.barrier()
        strategy.all_reduce(torch.tensor([1.0]))
        strategy.all_gather(torch.tensor([1.0]))
        strategy.broadcast("hello")
        strategy.setup_module(torch.nn.Linear(2, 2), precision=lite._plan.precision)
        strategy.reduce_gradients(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    names = {name for name, _ in record.calls}
    assert names == {"all_reduce", "all_gather", "reduce_gradients", "fsdp"}
    for name, kwargs in record.calls:
        if name == "fsdp":
            assert kwargs == {"pin_layout_in_collective_ops": True}  # nothing but torch-xla's default
        else:
            assert kwargs.get("pin_layout") is True, (name, kwargs)


def test_the_cpu_harness_settings_live_in_the_tests_only() -> None:
    # Unpinned layouts, parameter aliasing off and replicas started in turn are what XLA's CPU
    # device needs (tests/scripts/_cpu_harness.py); a TPU runs with torch-xla's defaults.
    source = "\n".join(path.read_text() for path in SRC.rglob("*.py"))
    for setting in ("pin_layout=False", "XLA_ENABLE_PARAM_ALIASING", "XLA_THREAD_POOL_SIZE", "_init_world_size_ordinal"):
        assert setting not in source
