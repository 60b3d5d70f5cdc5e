"""`lite_core.parallel.MeshLayout`: the sizes of `ModelParallelStrategy`'s mesh, checked in one
place, what is enabled, and `ModelParallelStrategy(mesh=...)` against the size keywords (the real
mesh and training on processes are in tests/integration/sharded/test_mesh_layout.py)."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

import lite_core
from lite_core import LightningLite
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.parallel import MeshLayout
from lite_core.strategies import ModelParallelStrategy


def _identity(model: nn.Module, device_mesh: object) -> nn.Module:
    return model


def _layout_of(strategy: ModelParallelStrategy, devices: int) -> MeshLayout:
    return LightningLite(accelerator="cpu", strategy=strategy, devices=devices).strategy.mesh_layout


def _one_sentence(message: str) -> bool:
    return message.count(". ") == 0 and message.endswith(".")


@pytest.mark.parametrize(("sizes", "message"), [
    ({"pipeline": 0}, "pipeline=0 is not valid: pass a positive integer."),
    ({"shard": -2}, "shard=-2 is not valid: pass a positive integer or 'auto'."),
    ({"tensor": 1.5}, "tensor=1.5 is not valid: pass a positive integer or 'auto'."),
    ({"context": "auto"}, "context='auto' is not valid: pass a positive integer."),
    ({"replicate": True}, "replicate=True is not valid: pass a positive integer."),
    ({"replicate": 2}, "replicate=2 is not built yet: pass replicate=1 and the whole data-parallel size as shard,"
                       " whose 'data_parallel' dimension parallelize_fn may fully_shard over."),
    ({"pipeline": 2, "context": 2}, "context > 1 cannot be combined with pipeline > 1 yet: choose one of them."),
])
def test_bad_sizes_are_refused_in_one_sentence_when_the_layout_is_made(sizes, message) -> None:
    with pytest.raises(ConfigurationError) as info:
        MeshLayout(**sizes)
    assert str(info.value) == message and _one_sentence(message)


@pytest.mark.parametrize(("sizes", "devices", "num_nodes", "product"), [
    ({"shard": 3}, 4, 1, "pipeline=1 x shard=3 x context=1 x tensor='auto'"),
    ({"pipeline": 3}, 4, 1, "pipeline=3 x shard='auto' x context=1 x tensor='auto'"),
    ({"shard": 2, "tensor": 2}, 4, 2, "pipeline=1 x shard=2 x context=1 x tensor=2"),
])
def test_sizes_that_do_not_make_the_world_size_are_refused_naming_the_fields(sizes, devices, num_nodes,
                                                                             product) -> None:
    with pytest.raises(ConfigurationError) as info:
        MeshLayout(**sizes).resolve(devices, num_nodes)
    assert str(info.value) == (
        f"{product} does not make the world size {devices * num_nodes} (devices={devices} x num_nodes={num_nodes}):"
        " choose sizes whose product is the number of processes, or leave shard or tensor 'auto'.")


@pytest.mark.parametrize(("sizes", "devices", "num_nodes", "resolved"), [
    ({}, 4, 2, (1, 2, 1, 4)),                     # both automatic: tensor within a node, data across nodes
    ({"tensor": 2}, 8, 1, (1, 4, 1, 2)),
    ({"shard": 2}, 8, 1, (1, 2, 1, 4)),
    ({"pipeline": 2}, 4, 1, (2, 2, 1, 1)),        # with a pipeline, both automatic: tensor 1
    ({"context": 2, "tensor": 2}, 8, 1, (1, 2, 2, 2)),
])
def test_auto_sizes_resolve_against_the_world_size(sizes, devices, num_nodes, resolved) -> None:
    layout = MeshLayout(**sizes).resolve(devices, num_nodes)
    assert (layout.pipeline, layout.shard, layout.context, layout.tensor) == resolved
    assert layout.is_resolved and layout.world_size == devices * num_nodes
    assert layout.resolve(devices, num_nodes) == layout  # resolving again changes nothing


def test_the_enabled_questions_follow_the_sizes() -> None:
    def enabled(layout: MeshLayout) -> dict[str, bool]:
        names = ("pipeline", "data", "replicate", "shard", "context", "tensor")
        return {name: getattr(layout, f"{name}_enabled") for name in names}

    assert not any(enabled(MeshLayout(shard=1, tensor=1)).values())
    assert enabled(MeshLayout(pipeline=2, shard=2, tensor=1)) == {
        "pipeline": True, "data": True, "replicate": False, "shard": True, "context": False, "tensor": False}
    assert enabled(MeshLayout(shard=1, context=2, tensor=2)) == {
        "pipeline": False, "data": False, "replicate": False, "shard": False, "context": True, "tensor": True}


def test_a_size_still_auto_cannot_answer_and_says_where_to_ask() -> None:
    layout = MeshLayout(pipeline=2, tensor=2)
    assert layout.pipeline_enabled and not layout.is_resolved
    with pytest.raises(MisuseError) as info:
        _ = layout.data_enabled
    assert str(info.value) == ("shard='auto' has no size until the processes are launched: ask the resolved layout"
                               " (strategy.mesh_layout, or layout.resolve(devices, num_nodes)) instead.")


def test_the_layout_is_frozen_and_public_from_the_package_root() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        MeshLayout().tensor = 2  # type: ignore[misc]
    assert lite_core.MeshLayout is MeshLayout and "MeshLayout" in lite_core.__all__


@pytest.mark.parametrize(("keywords", "layout", "devices"), [
    ({}, MeshLayout(), 4),
    ({"data_parallel_size": 2}, MeshLayout(shard=2), 4),
    ({"tensor_parallel_size": 1}, MeshLayout(tensor=1), 4),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, MeshLayout(pipeline=2, tensor=2), 8),
    ({"context_parallel_size": 2}, MeshLayout(context=2), 4),
])
def test_the_keywords_and_the_layout_make_the_same_mesh(keywords, layout, devices, clean_env) -> None:
    by_keywords = _layout_of(ModelParallelStrategy(_identity, **keywords), devices)
    by_layout = _layout_of(ModelParallelStrategy(_identity, mesh=layout), devices)
    assert by_keywords == by_layout
    assert (by_keywords.dim_names, by_keywords.shape) == (by_layout.dim_names, by_layout.shape)


def test_the_strategy_takes_its_pipeline_and_context_from_the_layout(clean_env) -> None:
    assert ModelParallelStrategy(_identity, mesh=MeshLayout(pipeline=2)).pipeline_parallel_size == 2
    assert ModelParallelStrategy(_identity, mesh=MeshLayout(context=2)).mesh_layout.context_enabled
    with pytest.raises(ConfigurationError, match="^precision='16-mixed' scales the loss before backward"):
        LightningLite(accelerator="cpu", strategy=ModelParallelStrategy(_identity, mesh=MeshLayout(pipeline=2)),
                      devices=2, precision="16-mixed")


@pytest.mark.parametrize(("keywords", "given"), [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"data_parallel_size": 1, "pipeline_parallel_size": 2}, "pipeline_parallel_size=2, data_parallel_size=1"),
    ({"context_parallel_size": 2}, "context_parallel_size=2"),
])
def test_a_layout_beside_size_keywords_is_refused_in_one_sentence(keywords, given) -> None:
    with pytest.raises(ConfigurationError) as info:
        ModelParallelStrategy(_identity, mesh=MeshLayout(tensor=2), **keywords)
    assert str(info.value) == (f"mesh= and {given} were both given: pass every size in mesh=MeshLayout(...) and"
                               " leave out the size keywords.")
    assert _one_sentence(str(info.value))


def test_a_mesh_that_is_not_a_layout_is_refused_in_one_sentence() -> None:
    with pytest.raises(ConfigurationError) as info:
        ModelParallelStrategy(_identity, mesh=(2, 2))  # type: ignore[arg-type]
    assert str(info.value) == ("mesh=(2, 2) is not a MeshLayout: pass mesh=lite_core.parallel.MeshLayout(...)"
                               " with the sizes.")


def test_a_layout_that_does_not_make_the_world_size_is_refused_at_construction(clean_env) -> None:
    with pytest.raises(ConfigurationError, match=r"^pipeline=1 x shard=3 x context=1 x tensor='auto' does not make"
                                                 r" the world size 4 \(devices=4 x num_nodes=1\)"):
        _layout_of(ModelParallelStrategy(_identity, mesh=MeshLayout(shard=3)), 4)


def test_the_repr_shows_the_sizes_asked_for(clean_env) -> None:
    strategy = LightningLite(accelerator="cpu", strategy=ModelParallelStrategy(_identity), devices=4).strategy
    assert "data_parallel_size='auto'" in repr(strategy) and "tensor_parallel_size='auto'" in repr(strategy)


@pytest.mark.parametrize(("sizes", "message"), [
    ({"expert": 0}, "expert=0 is not valid: pass a positive integer."),
    ({"shard": 4, "expert": 3}, "expert=3 does not divide the 4 data-parallel processes it borrows from: choose an"
                                " expert that divides shard."),
    ({"context": 2, "expert": 3}, "expert=3 is not a multiple of context=2: expert parallelism borrows whole"
                                  " context-parallel groups, so choose an expert that context divides."),
    ({"shard": 3, "context": 2, "expert": 4}, "expert=4 over context=2 borrows 2 data-parallel processes, which does"
                                              " not divide the 3: choose an expert that makes expert / context divide"
                                              " shard."),
])
def test_an_expert_size_that_cannot_be_borrowed_is_refused_in_one_sentence(sizes, message) -> None:
    with pytest.raises(ConfigurationError) as info:
        MeshLayout(**sizes)
    assert str(info.value) == message and _one_sentence(message)


def test_an_expert_size_that_does_not_divide_the_resolved_data_size_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="^expert=4 does not divide the 2 data-parallel processes"):
        MeshLayout(pipeline=2, expert=4).resolve(devices=4)


@pytest.mark.parametrize(("sizes", "devices", "names", "shape"), [
    ({"expert": 2}, 4, ("expert_data_parallel", "expert_parallel", "tensor_parallel"), (2, 2, 1)),
    ({"expert": 4}, 4, ("expert_data_parallel", "expert_parallel", "tensor_parallel"), (1, 4, 1)),
    ({"shard": 2, "tensor": 2, "expert": 2}, 4, ("expert_data_parallel", "expert_parallel", "tensor_parallel"),
     (1, 2, 2)),
    ({"shard": 2, "expert": 2}, 4, ("expert_data_parallel", "expert_parallel", "tensor_parallel"), (1, 2, 2)),
    ({"pipeline": 2, "expert": 2}, 8,
     ("pipeline_parallel", "expert_data_parallel", "expert_parallel", "tensor_parallel"), (2, 2, 2, 1)),
    # Under context parallelism the experts borrow whole context groups and expert / context data processes.
    ({"context": 2, "expert": 2}, 4,
     ("expert_data_parallel", "data_in_expert_parallel", "context_parallel", "tensor_parallel"), (2, 1, 2, 1)),
    ({"context": 2, "expert": 4}, 8,
     ("expert_data_parallel", "data_in_expert_parallel", "context_parallel", "tensor_parallel"), (2, 2, 2, 1)),
])
def test_experts_borrow_the_inner_data_parallel_processes_and_add_none(sizes, devices, names, shape) -> None:
    layout = MeshLayout(**sizes).resolve(devices)  # shard and tensor both automatic: the tensor dimension is 1
    assert (layout.dim_names, layout.shape) == (names, shape)
    assert layout.world_size == devices and layout.expert_enabled and layout.sizes()["expert"] == sizes["expert"]
    assert not MeshLayout(shard=2, tensor=1).expert_enabled


def test_the_world_size_message_leaves_the_borrowed_expert_size_out() -> None:
    with pytest.raises(ConfigurationError) as info:
        MeshLayout(shard=3, tensor=1, expert=3).resolve(devices=4)
    assert str(info.value).startswith("pipeline=1 x shard=3 x context=1 x tensor=1 does not make the world size 4")
