"""The layers a pipeline stage does not hold, as stand-ins the model's own forward may call.

A stage's part runs the user's `forward`, which calls every layer of the model. A layer of another
stage that sits outside `nn.Sequential`/`nn.ModuleList`/`nn.ModuleDict` is an `Absent` module: it
hands its input on unchanged (a layer of an earlier stage already ran there, a layer of a later
stage will run there), and it is false, so `if self.norm:` skips it as torchtitan's models do, and
`if self.norm is not None:` still works.

Handing the input on is exact only where nothing else is done with it, which `StageCalls` checks
on every call of the part: a layer of an earlier stage must get the stage's input (the previous
stage's output), and the first layer the stage holds must then get it unchanged; the tensor given
to the first layer of a later stage must be what the part returns. Anything else (`embed(x) *
scale`, `tok(x) + pos(positions)`) is refused in one sentence that names the guard to write.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lite_core.errors import MisuseError


class Absent(nn.Module):
    """Layer `name` of the model, held by another pipeline stage (`before`: an earlier one; `None`:
    the user's model after the cut, where no stage runs it)."""

    def __init__(self, name: str, before: bool | None) -> None:
        super().__init__()
        self.layer_name = name
        self.before = before
        self.calls: StageCalls | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is None:
            raise MisuseError(
                f"The layer '{self.layer_name}' is held by another pipeline stage, so this process cannot run the"
                " model's forward by itself: call the model that setup() returned, which runs every stage."
            )
        value = _handed_on(self.layer_name, args, kwargs)
        if self.calls is not None:  # a stage's part (`watch`)
            if self.before:
                self.calls.skipped(self.layer_name, value)
            else:
                self.calls.passed(self.layer_name, value)
        return value

    def __bool__(self) -> bool:
        return False

    def extra_repr(self) -> str:
        return f"{self.layer_name!r}, held by another pipeline stage"


def _handed_on(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The input a stand-in hands on: its one positional argument (or its one keyword argument)."""
    if args:
        return args[0]
    if len(kwargs) == 1:
        return next(iter(kwargs.values()))
    raise MisuseError(
        f"The layer '{name}', which this pipeline stage does not hold, was called without the tensor it would"
        f" hand on: pass that tensor first, or guard the call with `if self.{name}:` (a layer this stage does"
        " not hold is false)."
    )


class StageCalls:
    """What one call of a stage's part did with the layers it does not hold (see the module's docstring).

    Args:
        stage: the stage's index, for the messages.
        first_held: the name of the first layer the stage holds.
    """

    def __init__(self, stage: int, first_held: str) -> None:
        self._stage = stage
        self._first_held = first_held
        self._inputs: list[torch.Tensor] = []
        self._skipped: str | None = None
        self._passed: tuple[str, Any] | None = None

    def begin(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The part's forward pre-hook: the stage's input, as its forward receives it."""
        self._inputs = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        self._skipped = None
        self._passed = None

    def skipped(self, name: str, value: Any) -> None:
        """Layer `name` of an earlier stage handed on `value`, which must be the stage's input."""
        if not self._is_input(value):
            raise MisuseError(
                f"Pipeline stage {self._stage} does not hold '{name}', and your forward calls it on something other"
                " than the stage's input (the previous stage's output), so skipping it would change the result:"
                f" guard that code with `if self.{name}:` (a layer this stage does not hold is false)."
            )
        self._skipped = self._skipped or name

    def first_held_called(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The first held layer's pre-hook: after a skipped layer, it must get the stage's input."""
        if self._skipped is None:
            return
        value = args[0] if args else next(iter(kwargs.values()), None)
        if not self._is_input(value):
            raise MisuseError(
                f"Pipeline stage {self._stage} does not hold '{self._skipped}', and your forward changes its output"
                f" before '{self._first_held}', which the stage holds, so skipping '{self._skipped}' would change"
                f" the result: guard that code with `if self.{self._skipped}:` (a layer this stage does not hold"
                " is false)."
            )
        self._skipped = None  # checked once per call

    def passed(self, name: str, value: Any) -> None:
        """Layer `name` of a later stage handed on `value`: the first such is what the part must return."""
        if self._passed is None:
            self._passed = (name, value)

    def end(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """The part's forward hook: after a layer of a later stage, the part returns what it got."""
        if self._passed is not None and output is not self._passed[1]:
            name = self._passed[0]
            raise MisuseError(
                f"Pipeline stage {self._stage} does not hold '{name}', and your forward changes what it passes to"
                f" '{name}' before returning it, so the next stage would get another tensor: guard that code with"
                f" `if self.{name}:` (a layer this stage does not hold is false)."
            )

    def _is_input(self, value: Any) -> bool:
        return any(value is tensor for tensor in self._inputs)


def watch(part: nn.Module, stage: int, first_held: str) -> None:
    """Check every call of `part` (stage `stage`'s, after `parallelize_fn`: its hooks run after
    those it registered, on the inputs the forward gets) against its stand-ins; nothing to do for a
    part without stand-ins."""
    absent = [module for module in part.modules() if isinstance(module, Absent)]
    if not absent:
        return
    calls = StageCalls(stage, first_held)
    for module in absent:
        module.calls = calls
    part.register_forward_pre_hook(calls.begin, with_kwargs=True)
    part.register_forward_hook(calls.end, with_kwargs=True)
    if any(module.before for module in absent):
        # First among the layer's pre-hooks: FSDP2's own (fully_shard on the layer) hands the layer
        # a new tensor object for its input, to hook its post-backward, which is not the user's doing.
        part.get_submodule(first_held).register_forward_pre_hook(calls.first_held_called, with_kwargs=True,
                                                                 prepend=True)
