"""`ModelParallelStrategy` (with a pipeline dimension too) and `FSDPStrategy(replicate_size=...)` at
construction: the mesh's sizes, and bad input refused in one sentence (what needs processes is in
tests/integration/sharded)."""

from __future__ import annotations

import pytest
from torch import nn

from lite_core import LightningLite
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.plugins import CPUAccelerator, Precision
from lite_core.strategies import FSDPStrategy, ModelParallelStrategy


def _identity(model: nn.Module, device_mesh: object) -> nn.Module:
    return model


def _strategy_of(strategy: object, **kwargs: object) -> ModelParallelStrategy:
    return LightningLite(accelerator="cpu", strategy=strategy, **kwargs).strategy  # type: ignore[return-value]


def _one_sentence(message: str) -> bool:
    return message.count(". ") == 0 and message.endswith(".")


def test_auto_sizes_are_data_parallel_across_nodes_and_tensor_parallel_within_one(monkeypatch, clean_env) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("NODE_RANK", "0")
    assert _strategy_of(ModelParallelStrategy(_identity), devices=4, num_nodes=2).mesh_shape == (2, 4)
    assert _strategy_of(ModelParallelStrategy(_identity), devices=4).mesh_shape == (1, 4)
    assert _strategy_of(ModelParallelStrategy(_identity, data_parallel_size=2), devices=4).mesh_shape == (2, 2)
    assert _strategy_of(ModelParallelStrategy(_identity, tensor_parallel_size=1), devices=4).mesh_shape == (4, 1)


@pytest.mark.parametrize(("dp", "tp"), [(2, 3), (3, "auto"), ("auto", 3)])
def test_sizes_that_do_not_make_the_world_size_are_refused_at_construction(dp, tp, clean_env) -> None:
    with pytest.raises(ConfigurationError) as info:
        _strategy_of(ModelParallelStrategy(_identity, data_parallel_size=dp, tensor_parallel_size=tp), devices=4)
    message = str(info.value)
    assert message.startswith(f"pipeline_parallel_size=1 x data_parallel_size={dp!r} x context_parallel_size=1 x"
                              f" tensor_parallel_size={tp!r} does not make the world size 4")
    assert _one_sentence(message)


@pytest.mark.parametrize(("kwargs", "start"), [
    ({"data_parallel_size": 0}, "data_parallel_size=0 is not valid"),
    ({"tensor_parallel_size": "many"}, "tensor_parallel_size='many' is not valid"),
    ({"parallelize_fn": "plan"}, "parallelize_fn='plan' is not callable"),
])
def test_bad_arguments_are_refused_in_one_sentence(kwargs, start) -> None:
    with pytest.raises(ConfigurationError) as info:
        ModelParallelStrategy(**{"parallelize_fn": _identity, **kwargs})
    assert str(info.value).startswith(start) and _one_sentence(str(info.value))


def test_the_name_suffices_to_choose_it_and_setup_asks_for_the_function(clean_env) -> None:
    strategy = _strategy_of("model_parallel", devices=4)
    assert type(strategy) is ModelParallelStrategy and strategy.mesh_shape == (1, 4)
    with pytest.raises(MisuseError) as info:
        strategy.setup_module(nn.Linear(2, 2), precision=Precision())
    assert "pass strategy=ModelParallelStrategy(parallelize_fn=...)" in str(info.value)
    assert _one_sentence(str(info.value))


def test_the_device_mesh_before_launch_is_refused(clean_env) -> None:
    with pytest.raises(MisuseError, match="device_mesh was asked for before the processes were launched"):
        _ = _strategy_of(ModelParallelStrategy(_identity), devices=4).device_mesh


def test_float16_mixed_precision_is_refused_in_one_sentence(clean_env) -> None:
    with pytest.raises(ConfigurationError) as info:
        _strategy_of(ModelParallelStrategy(_identity), devices=4, precision="16-mixed")
    message = str(info.value)
    assert message == ("precision='16-mixed' is not supported by strategy='model_parallel' on accelerator='cpu':"
                       " choose one of ['32-true', 'bf16-mixed', 'bf16-true', 'nf4-torchao'].")


def test_an_accelerator_without_a_process_group_is_refused(clean_env) -> None:
    no_group = type("NoGroupAccelerator", (CPUAccelerator,), {"name": "nogroup", "distributed_backend": None})()
    with pytest.raises(ConfigurationError) as info:
        LightningLite(accelerator=no_group, strategy=ModelParallelStrategy(_identity), devices=4)
    message = str(info.value)
    assert message.startswith("strategy='model_parallel' does not run on accelerator='nogroup': it needs a"
                              " torch.distributed process group")
    assert _one_sentence(message)


def test_hsdp_replicate_size_must_divide_the_processes(clean_env) -> None:
    assert _strategy_of(FSDPStrategy(replicate_size=2), devices=4)._replicate_size == 2
    with pytest.raises(ConfigurationError) as info:
        _strategy_of(FSDPStrategy(replicate_size=3), devices=4)
    assert str(info.value).startswith("replicate_size=3 does not divide the 4 processes") and _one_sentence(str(info.value))
    with pytest.raises(ConfigurationError, match="replicate_size=0 is not valid"):
        FSDPStrategy(replicate_size=0)


# Pipeline parallelism (`pipeline_parallel_size`): the splitter itself is in test_pipeline_parallel.py.

def test_the_mesh_gains_a_pipeline_dimension_and_two_d_users_change_nothing(clean_env) -> None:
    assert _strategy_of(ModelParallelStrategy(_identity, pipeline_parallel_size=2), devices=4).mesh_shape == (2, 2, 1)
    assert _strategy_of(ModelParallelStrategy(_identity, pipeline_parallel_size=2, tensor_parallel_size=2),
                        devices=8).mesh_shape == (2, 2, 2)
    assert _strategy_of(ModelParallelStrategy(_identity, data_parallel_size=2), devices=4).mesh_shape == (2, 2)


@pytest.mark.parametrize(("kwargs", "start"), [
    ({"pipeline_schedule": "ZigZag"}, "pipeline_schedule='ZigZag' is not a schedule Lite runs: choose one of"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size=0 is not valid"),
    ({"microbatches": 0}, "microbatches=0 is not valid"),
    ({"pipeline_schedule": "GPipe", "stages_per_rank": 2}, "pipeline_schedule='GPipe' runs one stage per process"),
    ({"save_distributed_checkpoint": False}, "save_distributed_checkpoint=False cannot gather a pipeline's stages"),
    ({"loss_fn": "mse"}, "loss_fn='mse' is not callable"),
])
def test_bad_pipeline_arguments_are_refused_in_one_sentence(kwargs, start) -> None:
    with pytest.raises(ConfigurationError) as info:
        ModelParallelStrategy(_identity, **{"pipeline_parallel_size": 2, **kwargs})
    assert str(info.value).startswith(start) and _one_sentence(str(info.value))


def test_pipeline_sizes_that_do_not_make_the_world_size_are_refused(clean_env) -> None:
    with pytest.raises(ConfigurationError) as info:
        _strategy_of(ModelParallelStrategy(_identity, pipeline_parallel_size=2, data_parallel_size=3), devices=4)
    message = str(info.value)
    assert message.startswith("pipeline_parallel_size=2 x data_parallel_size=3 x context_parallel_size=1 x"
                              " tensor_parallel_size='auto' does not make the world size 4")
    assert _one_sentence(message)


def test_a_precision_the_pipeline_schedule_cannot_hold_is_refused(clean_env) -> None:
    with pytest.raises(ConfigurationError) as info:
        _strategy_of(ModelParallelStrategy(_identity, pipeline_parallel_size=2), devices=2, precision="16-mixed")
    assert str(info.value).startswith("precision='16-mixed' scales the loss before backward")
    assert _one_sentence(str(info.value))


@pytest.mark.parametrize(("kwargs", "devices", "sizes", "names"), [
    ({}, 4, {"pipeline": 1, "replicate": 1, "shard": 1, "context": 1, "tensor": 4, "expert": 1},
     ("data_parallel", "tensor_parallel")),
    ({"data_parallel_size": 2}, 4, {"pipeline": 1, "replicate": 1, "shard": 2, "context": 1, "tensor": 2, "expert": 1},
     ("data_parallel", "tensor_parallel")),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 8,
     {"pipeline": 2, "replicate": 1, "shard": 2, "context": 1, "tensor": 2, "expert": 1},
     ("pipeline_parallel", "data_parallel", "tensor_parallel")),
])
def test_the_mesh_layout_names_every_dimension(kwargs, devices, sizes, names, clean_env) -> None:
    layout = _strategy_of(ModelParallelStrategy(_identity, **kwargs), devices=devices).mesh_layout
    assert layout.sizes() == sizes and list(layout.sizes()) == [
        "pipeline", "replicate", "shard", "context", "tensor", "expert"]
    assert layout.dim_names == names and layout.world_size == devices
    assert layout.shape == tuple(sizes[n] for n in ("pipeline",) * (len(names) == 3) + ("shard", "tensor"))
    assert layout.data == layout.replicate * layout.shard


@pytest.mark.parametrize(("pp", "dp", "tp"), [(1, 2, 3), (2, 3, "auto"), (2, "auto", 3), (3, "auto", "auto"),
                                              (2, 2, 2)])
def test_one_sentence_refuses_every_layout_that_does_not_make_the_world_size(pp, dp, tp) -> None:
    from lite_core.strategies.model_parallel._mesh import requested

    with pytest.raises(ConfigurationError) as info:
        requested(None, {"pipeline": pp, "shard": dp, "context": 1, "tensor": tp}).resolve(devices=4, num_nodes=1)
    assert str(info.value) == (
        f"pipeline_parallel_size={pp} x data_parallel_size={dp!r} x context_parallel_size=1 x"
        f" tensor_parallel_size={tp!r} does not make the world size 4 (devices=4 x num_nodes=1): choose sizes whose product is the number of processes, or leave"
        " data_parallel_size or tensor_parallel_size 'auto'.")


def test_context_parallelism_is_a_mesh_dimension_between_data_and_tensor(clean_env) -> None:
    layout = _strategy_of(ModelParallelStrategy(_identity, context_parallel_size=2, tensor_parallel_size=2),
                          devices=8).mesh_layout
    assert layout.sizes() == {"pipeline": 1, "replicate": 1, "shard": 2, "context": 2, "tensor": 2, "expert": 1}
    assert layout.dim_names == ("data_parallel", "context_parallel", "tensor_parallel")
    assert layout.shape == (2, 2, 2)
    both_auto = _strategy_of(ModelParallelStrategy(_identity, context_parallel_size=2), devices=4).mesh_layout
    assert (both_auto.data, both_auto.context, both_auto.tensor) == (2, 2, 1)


@pytest.mark.parametrize(("kwargs", "start"), [
    ({"context_parallel_size": "auto"}, "context_parallel_size='auto' is not valid: pass a positive integer."),
    ({"context_parallel_size": 0}, "context_parallel_size=0 is not valid"),
    ({"context_parallel_buffers": ["rope.freqs"]}, "context_parallel_buffers=['rope.freqs'] is not valid"),
    ({"context_parallel_size": 2, "pipeline_parallel_size": 2},
     "context_parallel_size > 1 cannot be combined with pipeline_parallel_size > 1"),
])
def test_bad_context_parallel_arguments_are_refused_in_one_sentence(kwargs, start) -> None:
    with pytest.raises(ConfigurationError) as info:
        ModelParallelStrategy(_identity, **kwargs)
    assert str(info.value).startswith(start) and _one_sentence(str(info.value))


def test_context_sizes_that_do_not_make_the_world_size_are_refused(clean_env) -> None:
    with pytest.raises(ConfigurationError) as info:
        _strategy_of(ModelParallelStrategy(_identity, context_parallel_size=3), devices=4)
    assert str(info.value).startswith("pipeline_parallel_size=1 x data_parallel_size='auto' x context_parallel_size=3"
                                      " x tensor_parallel_size='auto' does not make the world size 4")
