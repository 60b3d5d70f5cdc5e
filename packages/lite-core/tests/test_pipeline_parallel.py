"""`ModelParallelStrategy(pipeline_parallel_size=...)` at construction, and the splitter that cuts a
model into stages by module names (what needs processes is in tests/integration/sharded)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.strategies import ModelParallelStrategy
from lite_core.strategies import _split


def _identity(model: nn.Module, device_mesh: object) -> nn.Module:
    return model


def _strategy_of(strategy: object, **kwargs: object) -> ModelParallelStrategy:
    return LightningLite(accelerator="cpu", strategy=strategy, **kwargs)._strategy  # type: ignore[return-value]


def _one_sentence(message: str) -> bool:
    return message.count(". ") == 0 and message.endswith(".")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


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


def test_sizes_that_do_not_make_the_world_size_are_refused(clean_env) -> None:
    with pytest.raises(ConfigurationError) as info:
        _strategy_of(ModelParallelStrategy(_identity, pipeline_parallel_size=2, data_parallel_size=3), devices=4)
    message = str(info.value)
    assert message.startswith("pipeline_parallel_size=2 x data_parallel_size=3 x tensor_parallel_size='auto'"
                              " does not make the world size 4")
    assert _one_sentence(message)


def test_a_precision_the_schedule_cannot_hold_is_refused(clean_env) -> None:
    with pytest.raises(ConfigurationError) as info:
        _strategy_of(ModelParallelStrategy(_identity, pipeline_parallel_size=2), devices=2, precision="16-mixed")
    assert str(info.value).startswith("precision='16-mixed' scales the loss before backward")
    assert _one_sentence(str(info.value))


def test_a_part_holds_its_units_under_the_unsplit_models_names() -> None:
    model = Net()
    stages, expanded = _split.assign_stages(model, ["blocks.2"], 2)
    assert stages == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]
    second = _split.part(model, set(stages[1]), expanded)
    assert sorted(second.state_dict()) == ["blocks.2.bias", "blocks.2.weight", "blocks.3.bias", "blocks.3.weight",
                                           "head.bias", "head.weight"]
    assert second.blocks._modules["2"] is model.blocks[2]  # shared, not copied
    assert len(model.blocks) == 4 and model.embed is not None  # the model itself is untouched
    x = torch.randn(3, 4)
    torch.testing.assert_close(second(x), model.head(model.blocks[3](model.blocks[2](x))))
    _split.trim(model, set(stages[0]), expanded)
    assert sorted(model.state_dict()) == ["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight",
                                          "embed.bias", "embed.weight"]


@pytest.mark.parametrize(("points", "stages", "start"), [
    (["blocks.9"], 2, "The split point 'blocks.9' names no module of Net"),
    (None, 9, "9 pipeline stages need at least as many layers"),
    (["blocks.2", "head"], 2, "2 split points make 3 stages, but the pipeline has 2"),
    (["embed"], 2, "The split point 'embed' does not begin a stage of its own"),
    (["head", "blocks.2"], 3, "The split points ['head', 'blocks.2'] are not in the order"),
])
def test_bad_split_points_are_refused_in_one_sentence(points, stages, start) -> None:
    model = Net()
    with pytest.raises(MisuseError) as info:
        _split.assign_stages(model, _split.split_names(model, points), stages)
    assert str(info.value).startswith(start) and _one_sentence(str(info.value))


def test_parameters_that_no_stage_would_own_are_refused() -> None:
    model = Net()
    model.scale = nn.Parameter(torch.ones(2))
    with pytest.raises(MisuseError, match="holds parameters of its own \\(scale\\) that no pipeline stage would own"):
        _split.assign_stages(model, ["blocks.2"], 2)
