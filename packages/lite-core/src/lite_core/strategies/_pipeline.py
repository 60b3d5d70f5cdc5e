"""The set-up model's forward pass under pipeline parallelism: one call of a
`torch.distributed.pipelining` schedule over this process's stages.

A schedule runs the forward and backward passes of every micro-batch together, so under
pipeline parallelism `model(x, target=y)` is the whole step's computation: it returns the batch's
loss (the mean of the micro-batches' losses, broadcast from the last stage so that every process
holds it) with the gradients already accumulated, and `backward(loss)` then has nothing left to
do. Under `torch.no_grad()` (or after `model.eval()`) the schedule runs forward only
(`schedule.eval`): `model(x, target=y)` returns the loss, `model(x)` the last stage's output, on
every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lite_core.errors import ConfigurationError, MisuseError

#: The schedules by name (`torch.distributed.pipelining.get_schedule_class`, case insensitive).
SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")

#: Whether the schedule divides the accumulated gradients by the number of micro-batches, which
#: makes them those of the mean loss over the whole batch (the loss function averages over its
#: micro-batch). Torch's default; a test turns it off to see exactness fail.
SCALE_GRADS = True


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

    Args:
        stages: this process's `PipelineStage`s, in stage order.
        schedule: the schedule class.
        microbatches: how many micro-batches each batch is cut into.
        group: the pipeline-parallel process group.
        last_rank: the rank, in `group`, of the process that holds the last stage.
        loss_fn: `loss_fn(output, target)`, averaging over its micro-batch; `None` until given.
        module: the user's model, holding this process's layers (its `training` flag decides).
        copies: (a part's copy of a module, the model's module) pairs whose flags follow the model's.
    """

    def __init__(self, stages: list[Any], schedule: type, microbatches: int, group: Any, last_rank: int,
                 loss_fn: Callable[..., torch.Tensor] | None, module: nn.Module,
                 copies: list[tuple[nn.Module, nn.Module]]) -> None:
        self._stages = stages
        self.module = module
        self.copies = copies
        self._schedule_class = schedule
        self._microbatches = microbatches
        self._group = group
        self._last_rank = last_rank
        self.loss_fn = loss_fn
        self._schedules: dict[bool, Any] = {}
        #: The loss the last training call returned, which `backward` recognises.
        self.last_loss: torch.Tensor | None = None
        self.calls = 0

    @property
    def holds_first_stage(self) -> bool:
        return any(stage.is_first for stage in self._stages)

    @property
    def holds_last_stage(self) -> bool:
        return any(stage.is_last for stage in self._stages)

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
        self._check_batch(args, kwargs, target)
        with_loss = target is not None
        schedule = self._schedule(with_loss)
        losses: list[torch.Tensor] = []
        run = schedule.step if training else schedule.eval
        # The batch goes to the first stage and the target to the last, as torch's schedules take
        # them (torch 2.11 refuses input args on any other stage; 2.13 ignores them).
        if not self.holds_first_stage:
            args, kwargs = (), {}
        if with_loss:
            if self.holds_last_stage:
                run(*args, target=target, losses=losses, **kwargs)
            else:
                run(*args, **kwargs)
            loss = self._broadcast_loss(losses)
            if training:
                self.last_loss = loss
            return loss
        return self._broadcast_output(run(*args, **kwargs))

    def _schedule(self, with_loss: bool) -> Any:
        if with_loss and self.loss_fn is None:
            raise MisuseError(
                "Under pipeline parallelism model(x, target=y) needs the loss function: pass"
                " setup(model, optimizer, loss_fn=loss_fn), or ModelParallelStrategy(..., loss_fn=loss_fn)."
            )
        if with_loss not in self._schedules:
            loss_fn = self.loss_fn if with_loss else None
            stage = self._stages if runs_several_stages(self._schedule_class) else self._stages[0]
            self._schedules[with_loss] = self._schedule_class(stage, self._microbatches, loss_fn=loss_fn,
                                                              scale_grads=SCALE_GRADS)
        return self._schedules[with_loss]

    def _check_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> None:
        tensors = [t for t in (*args, *kwargs.values(), target) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise MisuseError("Under pipeline parallelism the model takes tensors: pass the batch as tensors.")
        size = tensors[0].shape[0] if tensors[0].dim() else 0
        if size == 0 or size % self._microbatches:
            raise MisuseError(
                f"A batch of {size} samples does not split into microbatches={self._microbatches} equal"
                " micro-batches: choose a batch size (per data-parallel rank) that is a multiple of"
                " microbatches, or a microbatches that divides it."
            )

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        device = self._stages[0].device
        if self.holds_last_stage:
            loss = torch.stack([value.detach().float() for value in losses]).mean().to(device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)  # not the default dtype (bf16-true)
        dist.broadcast(loss, group=self._group, group_src=self._last_rank)
        return loss

    def _broadcast_output(self, output: Any) -> Any:
        """The last stage's output tensor, on every process of the pipeline."""
        device = self._stages[0].device
        meta = [(tuple(output.shape), output.dtype) if self.holds_last_stage else None]
        dist.broadcast_object_list(meta, group=self._group, group_src=self._last_rank, device=device)
        shape, dtype = meta[0]
        tensor = output.detach().contiguous() if self.holds_last_stage else torch.empty(shape, dtype=dtype,
                                                                                          device=device)
        dist.broadcast(tensor, group=self._group, group_src=self._last_rank)
        return tensor


def stages_on_rank(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stage indexes process `pp_rank` of the pipeline holds (looped: rank r holds r, r+pp, ...)."""
    return [pp_rank + index * pp_size for index in range(stages_per_rank)]


def build_stages(parts: list[nn.Module], indexes: list[int], num_stages: int, device: torch.device,
                 group: Any) -> list[Any]:
    """One `PipelineStage` per part (its input and output shapes are found on the first step)."""
    from torch.distributed.pipelining import PipelineStage

    return [PipelineStage(module, index, num_stages, device, group=group) for module, index in zip(parts, indexes)]


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
    """The pipeline's options, checked; `None` without a pipeline (`size == 1`)."""
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ConfigurationError(f"pipeline_parallel_size={size!r} is not valid: pass a positive integer (1: no pipeline).")
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
