"""The splitter that cuts a model into pipeline stages by module names (`ModelParallelStrategy(
pipeline_parallel_size=...)` at construction is in test_model_parallel.py; what needs processes
is in tests/integration/sharded)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from lite_core.errors import MisuseError
from lite_core.strategies.model_parallel import _absent, _pipeline, _rehearsal, _split


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


def test_a_part_holds_its_units_under_the_unsplit_models_names() -> None:
    model = Net()
    stages, expanded = _split.assign_stages(model, ["blocks.2"], 2)
    assert stages == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]
    second = _split.part(model, stages, 1, expanded)
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


class Transformer(nn.Module):
    """embed, blocks (a ModuleList), norm, head: a transformer's shape."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(layers)])
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = x + block(x)
        x = self.norm(x) if self.norm is not None else x
        return self.head(x) if self.head is not None else x


@pytest.mark.parametrize(("layers", "num_stages", "expected"), [
    (4, 2, [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm", "head"]]),
    (5, 2, [["embed", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "blocks.4", "norm", "head"]]),
    (4, 4, [["embed", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "norm", "head"]]),
    # fewer blocks than stages: every layer (the blocks among them) spread evenly
    (2, 3, [["embed", "blocks.0"], ["blocks.1", "norm"], ["head"]]),
])
def test_without_split_points_the_blocks_are_cut_evenly(layers, num_stages, expected) -> None:
    stages, _ = _split.assign_stages(Transformer(layers), [], num_stages)
    assert stages == expected


def test_the_largest_container_is_cut_and_one_below_own_parameters_is_passed_over() -> None:
    model = Net()  # embed, blocks (4), head
    model.extra = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # smaller: not cut
    stages, _ = _split.assign_stages(model, [], 2)
    assert stages == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head", "extra"]]
    owner = nn.Module()
    owner.scale = nn.Parameter(torch.ones(1))
    owner.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(8)])
    model.owner = owner  # its 8 layers cannot be cut out of it: the 4 blocks are
    assert _split.assign_stages(model, [], 2)[0][1][0] == "blocks.2"


def test_a_stage_without_the_blocks_keeps_an_empty_container_its_forward_iterates() -> None:
    model = Transformer()
    stages, expanded = _split.assign_stages(model, ["norm"], 2)  # a top-level cut: blocks all on stage 0
    assert stages == [["embed", "blocks"], ["norm", "head"]]
    second = _split.part(model, stages, 1, expanded)
    assert isinstance(second.blocks, nn.ModuleList) and len(second.blocks) == 0 and len(model.blocks) == 4
    assert sorted(second.state_dict()) == ["head.bias", "head.weight", "norm.bias", "norm.weight"]
    hidden = torch.randn(3, 4)
    torch.testing.assert_close(second(hidden), model.head(model.norm(hidden)))
    _split.trim(model, set(stages[1]), expanded)
    assert len(model.blocks) == 0 and not model.embed  # a stand-in, false for `if self.embed:`


def _forward(microbatches: int) -> _pipeline.PipelineForward:
    """A pipeline's forward on one process without a process group: a call that reached a
    collective would fail with torch's error, not Lite's."""
    layout = _pipeline.StageLayout([nn.Linear(2, 2)], [0], 2, torch.device("cpu"), None)
    module = layout.parts[0]
    return _pipeline.PipelineForward(layout, _pipeline.schedule_class("1F1B"), microbatches, 1,
                                     nn.functional.mse_loss, module, [])


@pytest.mark.parametrize(("batch", "target", "grad"), [(6, 6, True), (8, 6, True), (6, None, False), (2, 2, False)])
def test_a_batch_that_microbatches_does_not_divide_is_refused_before_any_collective(batch, target, grad) -> None:
    forward = _forward(microbatches=4)
    y = None if target is None else torch.zeros(target, 2)
    with torch.set_grad_enabled(grad), pytest.raises(MisuseError) as info:
        forward(torch.zeros(batch, 2), target=y)
    size = batch if batch % 4 else target
    assert str(info.value).startswith(f"A batch of {size} samples does not split into microbatches=4")
    assert _one_sentence(str(info.value))


def test_a_steps_gradients_wait_apart_and_backward_adds_them_scaled() -> None:
    from lite_core.strategies.model_parallel import _pipeline_backward

    layer = nn.Linear(2, 1)
    layer.weight.grad = torch.ones_like(layer.weight)  # an earlier batch's, accumulated

    def step() -> None:  # as the schedule's step: it computes, then divides every gradient it sees
        layer(torch.ones(1, 2)).sum().backward()
        for parameter in layer.parameters():
            parameter.grad.div_(2)

    gradients = _pipeline_backward.run_apart(layer.parameters(), step)
    assert torch.equal(layer.weight.grad, torch.ones_like(layer.weight)) and layer.bias.grad is None
    loss = torch.tensor(3.0, requires_grad=True)
    waiting = _pipeline_backward.StepGradients(weakref.ref(loss), gradients)
    [scale] = _pipeline_backward.scales(loss / 4, [loss])
    assert scale == 0.25
    waiting.add_into_grad(scale)
    torch.testing.assert_close(layer.weight.grad, torch.full_like(layer.weight, 1 + 0.5 * 0.25))
    torch.testing.assert_close(layer.bias.grad, torch.full_like(layer.bias, 0.5 * 0.25))


def test_backward_of_anything_but_a_function_of_the_pipelines_loss_is_refused_in_one_sentence() -> None:
    from lite_core.strategies.model_parallel import _pipeline_backward

    loss, weight = torch.tensor(3.0, requires_grad=True), nn.Parameter(torch.ones(2))
    assert _pipeline_backward.scales(loss, [loss]) == [1.0]
    assert _pipeline_backward.scales(loss * loss / 2, [loss]) == [3.0]  # the chain rule: d(L²/2)/dL = L
    with pytest.raises(MisuseError) as info:
        _pipeline_backward.scales(loss + weight.square().sum(), [loss])
    assert "compute any other term of the loss inside loss_fn" in str(info.value)
    assert _one_sentence(str(info.value))


class Unguarded(nn.Module):
    """A transformer's shape whose forward has no guards for the layers a stage does not hold;
    `scale`, `positions` and `after` add what no stand-in can skip."""

    def __init__(self, scale: float = 1.0, positions: bool = False, after: float = 1.0) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.pos = nn.Linear(1, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)
        self.scale, self.positions, self.after = scale, positions, after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if self.scale != 1.0:
            x = x * self.scale
        if self.positions:
            x = x + self.pos(torch.ones(x.shape[0], 1))
        for block in self.blocks:
            x = x + block(x)
        x = self.head(self.norm(x))
        return x * self.after if self.after != 1.0 else x


def _stages(model: nn.Module) -> list[nn.Module]:
    """The model's two parts (cut at blocks.2), each checked as under a pipeline."""
    stages, expanded = _split.assign_stages(model, ["blocks.2"], 2)
    parts = [_split.part(model, stages, index, expanded) for index in range(2)]
    for index, part in enumerate(parts):
        _absent.watch(part, index, stages[index][0])
    return parts


def test_a_forward_without_guards_runs_with_the_layers_a_stage_does_not_hold_handed_over() -> None:
    model = Unguarded()
    first, second = _stages(model)
    x = torch.randn(3, 4)
    assert not second.embed and not first.head and second.embed is not None  # `if self.embed:` skips it
    torch.testing.assert_close(second(first(x)), model(x), atol=0, rtol=0)
    with torch.no_grad():  # every call is checked alike
        torch.testing.assert_close(second(first(x)), model(x), atol=0, rtol=0)


@pytest.mark.parametrize(("model", "stage", "message"), [
    (Unguarded(scale=2.0), 1, "Pipeline stage 1 does not hold 'embed', and your forward changes its output before"
                              " 'blocks.2', which the stage holds"),
    (Unguarded(positions=True), 1, "Pipeline stage 1 does not hold 'pos', and your forward calls it on something"
                                   " other than the stage's input"),
    (Unguarded(after=2.0), 0, "Pipeline stage 0 does not hold 'norm', and your forward changes what it passes to"
                              " 'norm' before returning it"),
])
def test_a_forward_that_a_missing_layer_cannot_be_skipped_in_is_refused_in_one_sentence(model, stage, message) -> None:
    first, second = _stages(model)
    x = torch.randn(3, 4)
    with pytest.raises(MisuseError) as info:
        second(first(x).detach()) if stage == 1 else first(x)
    assert str(info.value).startswith(message) and "guard that code with `if self." in str(info.value)
    assert _one_sentence(str(info.value))


def _rehearsal_of(model: nn.Module) -> _rehearsal.Rehearsal:
    stages, expanded = _split.assign_stages(model, ["blocks.2"], 2)
    return _rehearsal.Rehearsal(model, stages, expanded, microbatches=2)


@pytest.mark.parametrize(("model", "message"), [
    (Unguarded(scale=2.0), "Pipeline stage 1 does not hold 'embed', and your forward changes its output before"),
    (Unguarded(positions=True), "Pipeline stage 1 does not hold 'pos', and your forward calls it on something"),
    (Unguarded(after=2.0), "Pipeline stage 0 does not hold 'norm', and your forward changes what it passes to"),
])
def test_the_rehearsal_refuses_what_any_stage_would_refuse_without_any_stage_running(model, message) -> None:
    # Every process rehearses every stage, so the stage that breaks the contract is refused on all
    # of them alike, before the schedule: alone, it left the other stages waiting for its data.
    with pytest.raises(MisuseError) as info:
        _rehearsal_of(model).check((torch.randn(6, 4),), {}, training=True)
    assert str(info.value).startswith(message)


class DataDependent(Unguarded):
    """A forward the meta device cannot run (it reads a value)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (2.0 if x.sum().item() > 0 else 1.0)


def test_the_rehearsal_passes_a_kept_contract_and_what_the_meta_device_cannot_run() -> None:
    for model in (Unguarded(), DataDependent()):
        _rehearsal_of(model).check((torch.randn(6, 4),), {}, training=True)
    weights = Unguarded().state_dict()  # the model itself is not touched
    model = Unguarded()
    model.load_state_dict(weights)
    _rehearsal_of(model).check((torch.randn(6, 4),), {}, training=False)
    assert all(not t.is_meta for t in model.state_dict().values()) and model.training


def test_the_models_own_forward_after_the_cut_names_the_set_up_model() -> None:
    model = Unguarded()
    stages, expanded = _split.assign_stages(model, ["blocks.2"], 2)
    _split.trim(model, set(stages[0]), expanded)
    with pytest.raises(MisuseError, match="The layer 'norm' is held by another pipeline stage"):
        model(torch.randn(3, 4))
