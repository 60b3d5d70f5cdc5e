"""Loading a one-file checkpoint (saved by `ddp`, one process, or any layout gathered whole) under
pipeline parallelism: each process keeps the entries of its own stages.

A sharded checkpoint needs nothing of this: torch distributed checkpoint reads just the entries a
process asks for. A one-file checkpoint holds the whole model, and an optimizer saved by
`Optimizer.state_dict()` numbers the whole model's parameters; under a pipeline the optimizer holds
only this process's, so the numbers are read against the order in which it held every parameter
before the model was cut into stages (recorded by the strategy at setup).
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lite_core.checkpoint import CheckpointIO
from lite_core.checkpoint._fsdp import _check_keys, _load_into, _split
from lite_core.checkpoint._state import is_keyed_by_name, positions_to_names, read_checkpoint, restore
from lite_core.precision.precision import Precision


def load_full(strategy: Any, path: str, state: dict[str, Any], strict: bool,
              weights_only: bool, checkpoint_io: CheckpointIO, precision: Precision) -> dict[str, Any]:
    """Restore `state`'s objects (and `precision`'s state) from the one-file checkpoint at `path`,
    read with `checkpoint_io`; return its content. `strategy` is the `ModelParallelStrategy` with the
    pipeline (handed in, not imported)."""
    content = read_checkpoint(path, checkpoint_io, weights_only)
    objects, plain = _split(state)
    _check_keys(objects, content, strict)
    for key, obj in objects.items():
        if key not in content:
            continue
        if isinstance(obj, Optimizer):
            value = _local_optimizer_state(strategy, obj, content[key])
        else:
            local = set(obj.state_dict())
            value = {name: tensor for name, tensor in content[key].items() if name in local}
        _load_into(strategy, obj, value, full=True, strict=strict)
    restore(plain, content, strict=strict, precision=precision)
    state.update(plain)
    return content


def _local_optimizer_state(strategy: Any, optimizer: Optimizer, saved: dict[str, Any]) -> Any:
    module = strategy.module_of(optimizer)
    if not is_keyed_by_name(saved):
        names = strategy.parameter_names_before_split(optimizer)
        saved = _by_name(saved, names) if names is not None else positions_to_names(saved, optimizer, module)
    local = {name for name, _ in module.named_parameters()}
    return {
        "state": {name: value for name, value in saved["state"].items() if name in local},
        "param_groups": [{**group, "params": [n for n in group["params"] if n in local]}
                         for group in saved["param_groups"]],
    }


def _by_name(saved: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A position-keyed optimizer state keyed by the names the positions had in the whole model."""
    state: dict[str, Any] = {}
    groups = []
    for group, group_names in zip(saved["param_groups"], names):
        for position, name in zip(group["params"], group_names):
            if position in saved["state"]:
                state[name] = saved["state"][position]
        groups.append({**group, "params": list(group_names)})
    return {"state": state, "param_groups": groups}
