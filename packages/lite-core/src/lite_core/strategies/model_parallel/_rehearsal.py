"""The contract of a forward without guards (`_absent`), checked for every stage of the pipeline at
once, on the meta device, before a new kind of call reaches the schedule.

A stage whose forward breaks the contract is refused by its own `StageCalls`, but only inside the
schedule: the other stages were by then waiting for activations or gradients that never came, until
the collective timeout (30 minutes by default) ended them with gloo's or NCCL's raw error. Here
every process runs every stage's part, in order, on empty meta tensors of the first micro-batch's
shapes, so a breach is the same one-sentence `MisuseError` on every process, before any
communication. What the meta device cannot run (data-dependent code, a kernel without a meta
implementation) says nothing here: the stages' own checks still see it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lite_core.errors import MisuseError
from lite_core.model._meta import meta_copy
from lite_core.strategies.model_parallel import _absent, _split


class Rehearsal:
    """Every stage's part of `module` (cut as `stage_units` says), on the meta device, each checked
    as the real stages are; `check` runs them on a batch's first micro-batch.

    Args:
        module: the whole model, before the cut.
        stage_units: per stage, the units it holds (`_split.assign_stages`).
        expanded: the containers cut open (`_split.assign_stages`).
        microbatches: how many micro-batches the schedule cuts a batch into.
    """

    def __init__(self, module: nn.Module, stage_units: list[list[str]], expanded: set[str], microbatches: int) -> None:
        whole = meta_copy(module)  # its own: the checks' hooks stay off the copy measure_flops counts
        self._parts = [_split.part(whole, stage_units, index, expanded) for index in range(len(stage_units))]
        for index, part in enumerate(self._parts):
            _absent.watch(part, index, stage_units[index][0])
        self._microbatches = microbatches
        self._dtype = next((p.dtype for p in whole.parameters() if p.is_floating_point()), torch.float32)

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any], training: bool) -> None:
        """Run the stages in order (in the model's mode, `training`) on `args`/`kwargs`'s first
        micro-batch; raise the `MisuseError` of a stage that breaks the contract."""
        args, kwargs = tree_map(self._first_micro_batch, (args, kwargs))
        for part in self._parts:
            part.train(training)
        try:
            with torch.no_grad(), torch.device("meta"):  # tensors the forward makes are meta ones too
                value = self._parts[0](*args, **kwargs)
                for part in self._parts[1:]:
                    value = part(*value) if isinstance(value, tuple) else part(value)
        except MisuseError:
            raise
        except Exception:  # noqa: BLE001 - the meta device cannot run it: the stages check it themselves
            return

    def _first_micro_batch(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        rows = value.shape[0] // self._microbatches if value.dim() else 0
        shape = (rows, *value.shape[1:]) if value.dim() else ()
        # The precision casts a floating batch to the parameters' dtype before the first stage does.
        dtype = self._dtype if value.is_floating_point() else value.dtype
        return torch.empty(shape, dtype=dtype, device="meta")
