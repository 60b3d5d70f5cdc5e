"""The set-up model's forward pass under pipeline parallelism: one call of a
`torch.distributed.pipelining` schedule over this process's stages.

A schedule runs the forward and backward passes of every micro-batch together, so under
pipeline parallelism `model(x, target=y)` is the whole step's computation: it returns the batch's
loss (the mean of the micro-batches' losses, broadcast from the last stage so that every process
holds it), and keeps the step's gradients apart until `backward(loss)`, or `backward(loss / n)`,
adds them into `.grad` (`_pipeline_backward`). Under `torch.no_grad()` (or after `model.eval()`) the schedule runs forward only
(`schedule.eval`): `model(x, target=y)` returns the loss, `model(x)` the last stage's output, on
every process. Each mode and batch shape runs on a schedule and stages of its own (a *plan*), so
the shapes always follow the batch and an evaluation leaves training's schedule untouched.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lite_core._experts import load_counters
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.strategies.model_parallel._pipeline_backward import StepGradients, run_apart
from lite_core.strategies.model_parallel._rehearsal import Rehearsal

#: The schedules by name (`torch.distributed.pipelining.get_schedule_class`, case insensitive).
SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")

#: Whether the schedule divides the accumulated gradients by the number of micro-batches, which
#: makes them those of the mean loss over the whole batch (the loss function averages over its
#: micro-batch). Torch's default; a test turns it off to see exactness fail.
SCALE_GRADS = True

#: How many plans (a schedule and its stages per batch shape) a model keeps in each mode: in
#: training, the batch and an epoch's last one; in evaluation, those with and without a loss.
MAX_PLANS_PER_MODE = 4


def schedule_class(name: str) -> type:
    """torch's schedule class named `name`; an unknown name fails in one sentence."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    if not isinstance(name, str) or name.lower() not in {n.lower() for n in SCHEDULE_NAMES}:
        raise ConfigurationError(
            f"pipeline_schedule={name!r} is not a schedule Lite runs: choose one of {list(SCHEDULE_NAMES)}."
        )
    return get_schedule_class(name)


def runs_several_stages(cls: type) -> bool:
    """Whether the schedule drives several stages per process (interleaved, looped)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(cls, PipelineScheduleMulti)


class PipelineForward:
    """What `model(...)` calls under pipeline parallelism (see the module's docstring).

    Each kind of call runs on a *plan* of its own: a schedule over `PipelineStage`s of its own,
    keyed by the mode (training or evaluation), whether a loss is computed, and the shapes and
    dtypes of the batch. torch's stages size their receive buffers on their first step and keep
    them, and two schedules over the same stages overwrite each other's buffers (an evaluation's
    `model(x)` left the training schedule receiving activations that need no gradient); with a
    plan per kind, a batch of another size gets buffers of its own size, and an evaluation touches
    nothing that training uses. Plans are dropped oldest first beyond `MAX_PLANS_PER_MODE`.

    Args:
        layout: this process's stages before they are built.
        schedule: the schedule class.
        microbatches: how many micro-batches each batch is cut into.
        last_rank: the rank, in the pipeline group, of the process that holds the last stage.
        loss_fn: `loss_fn(output, target)`, averaging over its micro-batch; `None` until given.
        module: the user's model, holding this process's layers (its `training` flag decides).
        copies: (a part's copy of a module, the model's module) pairs whose flags follow the model's.
        whole_model: the whole model before the cut, on the meta device (`measure_flops` counts it).
        rehearsal: every stage on the meta device, to check a new kind of call's forward on every
            process before the schedule runs it (`_rehearsal`).
    """

    def __init__(self, layout: StageLayout, schedule: type, microbatches: int, last_rank: int,
                 loss_fn: Callable[..., torch.Tensor] | None, module: nn.Module,
                 copies: list[tuple[nn.Module, nn.Module]], whole_model: nn.Module | None = None,
                 rehearsal: Rehearsal | None = None) -> None:
        self._layout = layout
        self._rehearsal = rehearsal
        self.whole_model = whole_model
        self.module = module
        self.copies = copies
        self._schedule_class = schedule
        self._microbatches = microbatches
        self._group = layout.group
        self._last_rank = last_rank
        self.loss_fn = loss_fn
        self._plans: OrderedDict[tuple[Any, ...], _Plan] = OrderedDict()
        #: The training calls whose gradients wait for `backward` of their loss (oldest first).
        self._steps: list[StepGradients] = []
        self.calls = 0

    @property
    def holds_first_stage(self) -> bool:
        return self._layout.holds_first

    @property
    def holds_last_stage(self) -> bool:
        return self._layout.holds_last

    def __call__(self, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        self.calls += 1
        # model.eval() counts as evaluation too: a schedule's step would run backward and leave
        # gradients behind, where a forward pass elsewhere leaves none.
        for copy, original in self.copies:  # model.train()/eval() reached the model, not the parts' copies
            copy.training = original.training
        training = torch.is_grad_enabled() and self.module.training
        if training and target is None:
            raise MisuseError(
                "Under pipeline parallelism a training forward pass needs the target, because the schedule runs"
                " forward and backward together: call loss = model(x, target=y) with setup(..., loss_fn=...),"
                " or run under torch.no_grad() for outputs."
            )
        shapes = self._check_batch(args, kwargs, target)
        with_loss = target is not None
        if with_loss and self.loss_fn is None:
            raise MisuseError(
                "Under pipeline parallelism model(x, target=y) needs the loss function: pass"
                " setup(model, optimizer, loss_fn=loss_fn), or ModelParallelStrategy(..., loss_fn=loss_fn)."
            )
        plan = self._plan((training, with_loss, shapes), args, kwargs)
        # The batch goes to the first stage and the target to the last, as torch's schedules take
        # them (torch 2.11 refuses input args on any other stage; 2.13 ignores them).
        if not self.holds_first_stage:
            args, kwargs = (), {}
        if not self.holds_last_stage:
            target = None
        try:
            with self._shape_inference_undone(plan):
                if training:
                    return self._train(plan, args, kwargs, target)
                return self._evaluate(plan, args, kwargs, target, with_loss)
        finally:
            plan.release()

    @contextmanager
    def _shape_inference_undone(self, plan: _Plan) -> Iterator[None]:
        """On a plan's first call, put the buffers back as they were before torch's shape inference:
        each stage learns its shapes by running its part once before the micro-batches (on the
        batch, or on uninitialised tensors of the shapes it receives), in the model's mode, which
        would count that pass in a BatchNorm's running statistics and in `expert_load`'s tokens per
        expert; it is each part's first forward, and the buffers and the token counts are put back
        before the second (the first micro-batch's)."""
        if not plan.fresh:
            yield
            return
        handles = [_restore_after_first_forward(part) for part in self._layout.parts]
        try:
            yield
            plan.fresh = False
        finally:
            for handle in handles:
                handle.remove()

    def _train(self, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> torch.Tensor:
        """The schedule's step: forward and backward over every micro-batch, with the gradients
        set aside (they wait for `backward`); the batch's loss, a leaf that `backward` recognises."""
        losses: list[torch.Tensor] = []

        def step() -> None:
            if target is not None:
                plan.schedule.step(*args, target=target, losses=losses, **kwargs)
            else:
                plan.schedule.step(*args, **kwargs)

        gradients = run_apart(self.module.parameters(), step)
        loss = self._broadcast_loss(losses).requires_grad_()
        self._steps = [each for each in self._steps if each.loss() is not None]  # losses dropped: no backward
        self._steps.append(StepGradients(weakref.ref(loss), gradients))
        return loss

    def waiting(self) -> list[tuple[torch.Tensor, StepGradients]]:
        """(loss, its step's gradients) of the training calls whose loss `backward` has not taken yet."""
        found = [(each.loss(), each) for each in self._steps]
        return [(loss, each) for loss, each in found if loss is not None]

    def taken(self, step: StepGradients) -> None:
        """`backward` added `step`'s gradients into `.grad`."""
        self._steps = [each for each in self._steps if each is not step]

    def _evaluate(self, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                  with_loss: bool) -> Any:
        """A forward-only pass (`schedule.eval`) that leaves training as it was: its plan is its own,
        it builds no graph, and the gradients are set aside while it runs (torch's single-stage
        schedules end `eval` as they end `step`, with the gradients' scaling and FSDP's reduction,
        and building a plan drops FSDP's gradients)."""
        gradients = [(parameter, parameter.grad) for parameter in self.module.parameters()]
        losses: list[torch.Tensor] = []
        try:
            for parameter, _ in gradients:
                parameter.grad = None
            with torch.no_grad():
                if target is not None:
                    output = plan.schedule.eval(*args, target=target, losses=losses, **kwargs)
                else:
                    output = plan.schedule.eval(*args, **kwargs)
        finally:
            for parameter, grad in gradients:
                parameter.grad = grad
        if with_loss:
            return self._broadcast_loss(losses)
        return self._broadcast_output(output)

    def _plan(self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Plan:
        """The plan for calls like this one, built on its first use (after checking that every
        stage of the pipeline builds the same one, and rehearsing the call's forward on every
        stage)."""
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        self._agree(key)
        if self._rehearsal is not None:
            self._rehearsal.check(args, kwargs, self.module.training)
        training, with_loss, _ = key
        stages = self._layout.build()
        stage = stages if runs_several_stages(self._schedule_class) else stages[0]
        # An evaluation plan only ever runs `schedule.eval`, so its stages are set up forward only,
        # and it has no gradients to scale.
        schedule = self._schedule_class(stage, self._microbatches, loss_fn=self.loss_fn if with_loss else None,
                                        scale_grads=SCALE_GRADS and training)
        plan = self._plans[key] = _Plan(schedule, stages)
        same_mode = [each for each in self._plans if each[0] == training]  # oldest first
        for old in same_mode[:-MAX_PLANS_PER_MODE]:  # evaluation never drops training's plans
            del self._plans[old]
        return plan

    def _agree(self, key: tuple[Any, ...]) -> None:
        """Refuse, on every stage, a call that the stages of the pipeline do not make alike (another
        batch size on one of them would leave the others waiting for data that never comes)."""
        digest = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "big")
        seen = torch.tensor([digest, -digest], dtype=torch.int64, device=self._layout.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self._group)
        if seen[0].item() != digest or -seen[1].item() != digest:
            raise MisuseError(
                "The stages of the pipeline were called with different batches (shapes, dtypes, target or"
                " mode): call model(...) on every process of the pipeline with the same batch, as the set-up"
                " loader gives it."
            )

    def _check_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> tuple[Any, ...]:
        """The batch's tensors' shapes and dtypes; a batch that does not cut into `microbatches`
        equal parts is refused here, before any collective, on every stage alike."""
        named = [*(("", t) for t in args), *sorted(kwargs.items()), ("target", target)]
        tensors = [(name, t) for name, t in named if isinstance(t, torch.Tensor)]
        if not tensors:
            raise MisuseError("Under pipeline parallelism the model takes tensors: pass the batch as tensors.")
        for _, tensor in tensors:
            size = tensor.shape[0] if tensor.dim() else 0
            if size == 0 or size % self._microbatches:
                raise MisuseError(
                    f"A batch of {size} samples does not split into microbatches={self._microbatches} equal"
                    " micro-batches: choose batch sizes (per data-parallel rank; evaluation batches and an"
                    " epoch's last batch included) that are multiples of microbatches, or drop_last=True."
                )
        return tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        device = self._layout.device
        if self.holds_last_stage:
            loss = torch.stack([value.detach().float() for value in losses]).mean().to(device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)  # not the default dtype (bf16-true)
        dist.broadcast(loss, group=self._group, group_src=self._last_rank)
        return loss

    def _broadcast_output(self, output: Any) -> Any:
        """The last stage's output tensor, on every process of the pipeline."""
        device = self._layout.device
        meta = [(tuple(output.shape), output.dtype) if self.holds_last_stage else None]
        dist.broadcast_object_list(meta, group=self._group, group_src=self._last_rank, device=device)
        shape, dtype = meta[0]
        tensor = output.detach().contiguous() if self.holds_last_stage else torch.empty(shape, dtype=dtype,
                                                                                          device=device)
        dist.broadcast(tensor, group=self._group, group_src=self._last_rank)
        return tensor


def _restore_after_first_forward(module: nn.Module) -> Any:
    """A hook that puts `module`'s buffers and its experts' token counts (`load_counters`) back as
    they are now just before its second forward pass (once, when the first one's graph is gone: a
    BatchNorm's backward checks its buffers' versions); its handle."""
    saved = [(buffer, buffer.detach().clone()) for buffer in (*module.buffers(), *load_counters(module))]
    calls: list[bool] = []

    def restore(*_: Any) -> None:
        calls.append(True)
        if len(calls) == 2:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)

    return module.register_forward_pre_hook(restore)


def stages_on_rank(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stage indexes process `pp_rank` of the pipeline holds (looped: rank r holds r, r+pp, ...)."""
    return [pp_rank + index * pp_size for index in range(stages_per_rank)]


@dataclass(frozen=True)
class StageLayout:
    """This process's stages before they are built: each plan builds `PipelineStage`s of its own
    over the same parts (a stage's input and output shapes are found on its first step).

    Args:
        parts: this process's parts of the model, in stage order.
        indexes: their stage indexes.
        num_stages: the pipeline's stages, over every process.
        device: where the stages run.
        group: the pipeline-parallel process group.
    """

    parts: list[nn.Module]
    indexes: list[int]
    num_stages: int
    device: torch.device
    group: Any

    @property
    def holds_first(self) -> bool:
        return 0 in self.indexes

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.indexes

    def build(self) -> list[Any]:
        """One new `PipelineStage` per part."""
        from torch.distributed.pipelining import PipelineStage

        return [PipelineStage(part, index, self.num_stages, self.device, group=self.group)
                for part, index in zip(self.parts, self.indexes)]


@dataclass
class _Plan:
    """A schedule and the stages it runs, for one kind of call (see `PipelineForward`); `fresh`
    until its first call has run."""

    schedule: Any
    stages: list[Any]
    fresh: bool = True

    def release(self) -> None:
        """Drop what the last call left in the stages (outputs, activations), keeping the buffers."""
        for stage in self.stages:
            stage.clear_runtime_states()


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline's options, checked (see `ModelParallelStrategy`)."""

    size: int
    schedule_name: str
    schedule: type
    microbatches: int
    split_points: list[str | int] | None
    stages_per_rank: int
    loss_fn: Callable[..., Any] | None


def options(size: int, schedule_name: str, microbatches: int | None, split_points: Any,
            stages_per_rank: int | None, loss_fn: Any) -> PipelineOptions | None:
    """The pipeline's options, checked; `None` without a pipeline (`size == 1`, a size that
    `MeshLayout` has checked)."""
    if size == 1:
        return None
    schedule = schedule_class(schedule_name)
    several = runs_several_stages(schedule)
    per_rank = stages_per_rank if stages_per_rank is not None else (2 if several else 1)
    if not several and per_rank != 1:
        raise ConfigurationError(
            f"pipeline_schedule={schedule_name!r} runs one stage per process, not stages_per_rank={per_rank}:"
            " choose 'Interleaved1F1B' for several, or leave stages_per_rank unset."
        )
    microbatches = microbatches if microbatches is not None else size * per_rank
    if not (isinstance(microbatches, int) and not isinstance(microbatches, bool) and microbatches >= 1):
        raise ConfigurationError(f"microbatches={microbatches!r} is not valid: pass a positive integer.")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigurationError(f"loss_fn={loss_fn!r} is not callable: pass a function loss_fn(output, target).")
    return PipelineOptions(size, schedule_name, schedule, microbatches,
                           list(split_points) if split_points is not None else None, per_rank, loss_fn)
