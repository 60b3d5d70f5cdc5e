"""Turns checkpoint content into plain state and restores it into live objects."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor, nn
from torch.optim import Optimizer

from lite_core.checkpoint._plain import plain_tensors
from lite_core.checkpoint._stateful import is_stateful
from lite_core.checkpoint._store import READER_FILE
from lite_core.model._module import user_class_of
from lite_core.errors import CheckpointError

if TYPE_CHECKING:
    from lite_core.checkpoint._io import CheckpointIO
    from lite_core.precision.precision import Precision

#: Key under which the precision plugin's state (e.g. the gradient scaler) is stored.
PRECISION_KEY = "lite_precision"


def to_state(content: dict[str, Any], precision: Precision) -> dict[str, Any]:
    """`content` with every stateful object replaced by its `state_dict()`, and `precision`'s state
    (the job's precision plugin: a gradient scaler's) under `PRECISION_KEY` where it has any.

    Stateful means a module, an optimizer, or any object with both `state_dict()` and
    `load_state_dict()` (an LR scheduler, a `GradScaler`, your own class); other values are kept
    as they are. The objects themselves are never pickled, so the file loads with `weights_only`;
    nor are the tensor subclasses a precision wraps parameters in (`plain_tensors`).
    """
    state = plain_tensors({key: state_of(value) for key, value in content.items()})
    precision_state = precision.state_dict()
    if precision_state:
        state[PRECISION_KEY] = precision_state
    return state


def state_of(value: Any) -> Any:
    """`value.state_dict()` for a stateful object (see `is_stateful`), else `value` itself."""
    return value.state_dict() if is_stateful(value) else value




def read_checkpoint(path: str, io: CheckpointIO, weights_only: bool) -> dict[str, Any]:
    """The content of a full checkpoint file, or of a sharded checkpoint directory (read whole)."""
    from lite_core.checkpoint._sharded import is_sharded, read_sharded

    if is_sharded(path):
        return read_sharded(path, io, weights_only=weights_only)
    if os.path.isdir(path):
        if not os.listdir(path):
            raise CheckpointError(f"'{path}' is an empty directory, not a checkpoint: check the path.")
        if os.path.isfile(os.path.join(path, READER_FILE)):  # a backend's own format, read by that backend
            return _backend_reader(path)(path, weights_only=weights_only)
        raise CheckpointError(
            f"'{path}' is a directory but not a sharded checkpoint that Lite reads under every strategy:"
            " load it under the strategy that saved it, or convert it to one file with that backend's tool."
        )
    return io.load(path, weights_only=weights_only)


def _backend_reader(path: str) -> Any:
    from lite_core._registry import STRATEGIES

    with open(os.path.join(path, READER_FILE)) as file:
        name = file.read().strip()
    return STRATEGIES.load(name).read_whole_checkpoint


def restore(state: dict[str, Any], content: dict[str, Any], strict: bool, precision: Precision) -> None:
    """Load `content` into the objects of `state` in place, and its `PRECISION_KEY` entry into
    `precision` (the job's); plain values are replaced."""
    missing = [key for key in state if key not in content]
    if strict and missing:
        raise CheckpointError(
            f"The checkpoint has no entry for {missing}: save them too, or load with strict=False."
        )
    if PRECISION_KEY in content:
        precision.load_state_dict(content.pop(PRECISION_KEY))
    for key, target in list(state.items()):
        if key not in content:
            continue
        if isinstance(target, nn.Module):
            load_module_state(target, content[key], strict, target.load_state_dict)
        elif isinstance(target, Optimizer) and is_keyed_by_name(content[key]):
            module = module_of(target, state)
            target.load_state_dict(names_to_positions(content[key], target, module))
        elif isinstance(target, Optimizer) or hasattr(target, "load_state_dict"):
            target.load_state_dict(content[key])
        else:
            state[key] = content[key]


def load_module_state(module: nn.Module, module_state: Any, strict: bool, load: Callable[..., Any]) -> None:
    """`load(module_state, strict=strict)`; where torch refuses the load because the keys differ
    (a strict load) or a weight has another shape (any load), a `CheckpointError` that says how
    (`check_module_keys`, `check_module_shapes`) instead of torch's full lists."""
    try:
        load(module_state, strict=strict)
    except (RuntimeError, KeyError) as error:
        if isinstance(module_state, Mapping):
            own = module.state_dict(keep_vars=True)
            if strict:
                check_module_keys(module, own, module_state, error)
            check_module_shapes(module, shapes_of(own), shapes_of(module_state), error)
        raise


#: How many of the differing keys of each kind a key-mismatch error names.
_KEYS_SHOWN = 3


def check_module_keys(module: nn.Module, expected: Iterable[str], saved: Iterable[str],
                      cause: BaseException | None = None) -> None:
    """Raise a `CheckpointError` naming `module`'s class, how many keys differ between the
    `expected` (the module's own state dict) and the `saved` ones, and the first few of each."""
    expected_keys = list(expected)
    saved_keys = list(saved)
    missing = _not_in(expected_keys, saved_keys)
    unexpected = _not_in(saved_keys, expected_keys)
    if not missing and not unexpected:
        return
    raise CheckpointError(
        f"The checkpoint's weights do not fit this {user_class_of(module).__name__}:"
        f" {len(missing) + len(unexpected)} keys differ ({len(missing)} missing from the checkpoint{_first(missing)};"
        f" {len(unexpected)} unexpected{_first(unexpected)}): load it into the model it was saved from, or"
        " pass strict=False to load only the keys that match."
    ) from cause


def shapes_of(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor in a state dict (a `DTensor`'s is the whole tensor's), by key."""
    return {key: tuple(value.shape) for key, value in state.items() if isinstance(value, Tensor)}


def check_module_shapes(module: nn.Module, expected: Mapping[str, Sequence[int]], saved: Mapping[str, Sequence[int]],
                        cause: BaseException | None = None) -> None:
    """Raise a `CheckpointError` naming `module`'s class, how many of the keys that both the
    module (`expected`: its shapes by key) and the checkpoint (`saved`) hold have another shape
    in the checkpoint, and the first few with both shapes.

    No load can fill a weight from one of another shape: `strict=False` passes over missing and
    unexpected keys only, so the message names the model the checkpoint was saved from."""
    differing = [key for key in expected if key in saved and tuple(saved[key]) != tuple(expected[key])]
    if not differing:
        return
    shown = "; ".join(f"{key!r}: {tuple(saved[key])} saved, {tuple(expected[key])} here"
                      for key in differing[:_KEYS_SHOWN])
    among = "among them " if len(differing) > _KEYS_SHOWN else ""
    count = "1 weight has" if len(differing) == 1 else f"{len(differing)} weights have"
    raise CheckpointError(
        f"The checkpoint's weights do not fit this {user_class_of(module).__name__}:"
        f" {count} another shape in the checkpoint ({among}{shown}): load it into"
        " a model built like the one it was saved from (strict=False passes over missing and unexpected"
        " keys, not weights of another shape)."
    ) from cause


def check_weights_fit(module: nn.Module, expected: Mapping[str, Sequence[int]], saved: Mapping[str, Sequence[int]],
                      strict: bool) -> None:
    """Raise a `CheckpointError` where a checkpoint's weights (`saved`: their whole shapes by key)
    do not fit `module` (`expected`: its own whole shapes by key): keys that differ, in a `strict`
    load, and weights of another shape, in any load. For a backend whose engine would otherwise
    fail with its own message, or copy a weight of the same size but another shape silently."""
    if strict:
        check_module_keys(module, expected, saved)
    check_module_shapes(module, expected, saved)


def _not_in(keys: list[str], others: list[str]) -> list[str]:
    known = set(others)
    return [key for key in keys if key not in known]


def _first(keys: list[str]) -> str:
    if not keys:
        return ""
    shown = ", ".join(repr(key) for key in keys[:_KEYS_SHOWN])
    return f", among them {shown}" if len(keys) > _KEYS_SHOWN else f": {shown}"


def is_keyed_by_name(optimizer_state: Any) -> bool:
    """Whether an optimizer state dict names its parameters (`"layer.weight"`), as the sharded
    strategies save it, rather than numbering them as `Optimizer.state_dict()` does."""
    if not isinstance(optimizer_state, dict):
        return False
    groups = optimizer_state.get("param_groups") or []
    return any(isinstance(p, str) for group in groups for p in group.get("params", []))


def module_of(optimizer: Optimizer, state: dict[str, Any]) -> nn.Module:
    """The user's module in `state` that owns `optimizer`'s parameters."""
    first = optimizer.param_groups[0]["params"][0]
    for value in state.values():  # a set-up model is the user's module itself
        # an entry standing for part of a model (`TrainableState`) names the model as `module`
        module = value if isinstance(value, nn.Module) else getattr(value, "module", None)
        if isinstance(module, nn.Module) and any(p is first for p in module.parameters()):
            return module
    raise CheckpointError(
        "The checkpoint names the optimizer's parameters, but `state` holds no model that owns them:"
        " pass the model in the same `state` as its optimizer."
    )


def _parameter_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def names_to_positions(optimizer_state: dict[str, Any], optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """A name-keyed optimizer state dict renumbered in `optimizer`'s parameter order."""
    names = _parameter_names(module)
    state: dict[int, Any] = {}
    groups = []
    position = 0
    for saved, group in zip(optimizer_state["param_groups"], optimizer.param_groups):
        positions = []
        for param in group["params"]:
            name = names[id(param)]
            if name in optimizer_state["state"]:
                state[position] = optimizer_state["state"][name]
            positions.append(position)
            position += 1
        groups.append({**saved, "params": positions})
    return {"state": state, "param_groups": groups}


def positions_to_names(optimizer_state: dict[str, Any], optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """A position-keyed optimizer state dict (`Optimizer.state_dict()`) keyed by parameter name."""
    names = _parameter_names(module)
    state: dict[str, Any] = {}
    groups = []
    for saved, group in zip(optimizer_state["param_groups"], optimizer.param_groups):
        for position, param in zip(saved["params"], group["params"]):
            if position in optimizer_state["state"]:
                state[names[id(param)]] = optimizer_state["state"][position]
        groups.append({**saved, "params": [names[id(p)] for p in group["params"]]})
    return {"state": state, "param_groups": groups}
