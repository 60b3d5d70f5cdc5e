"""Putting tensors on a device wherever they sit in the user's data.

Two walks share this module:

* `move_to_device` moves a batch: tensors, and objects with a `.to(device)` method (e.g. a
  tokenizer's output), inside dicts, lists, tuples, namedtuples and dataclasses (frozen ones
  too), nested to any depth. Every other object is returned as it is.
* `collective_input` prepares the argument of a collective: Python numbers become tensors and
  every tensor goes to the device, inside dicts, lists, tuples and namedtuples.

The common batch (a tensor, or a flat tuple, list or dict of tensors already on the device) is
recognised without a walk and returned unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

Tensor = torch.Tensor


def move_to_device(batch: Any, device: torch.device, move_tensor: Callable[[Tensor], Tensor] | None = None) -> Any:
    """`batch` with every tensor and every object with a `.to(device)` method on `device`.

    Args:
        batch: tensors and `.to()` objects in dicts, lists, tuples, namedtuples and dataclasses.
        device: where they go.
        move_tensor: how one tensor goes there (a backend's own way, e.g. XLA's); `.to(device)`
            by default.
    """
    if already_on(batch, device):
        return batch
    return _move(batch, device, move_tensor or (lambda tensor: tensor.to(device)))


def already_on(batch: Any, device: torch.device) -> bool:
    """Whether `batch` is a tensor, or a flat tuple, list or dict of tensors, all on `device`
    (the common batch: then nothing needs a walk). Runs once per batch, so it calls nothing."""
    kind = type(batch)
    if kind is Tensor:
        return batch.device == device
    if kind is tuple or kind is list:
        values = batch
    elif kind is dict:
        values = batch.values()
    else:
        return False
    for value in values:
        if type(value) is not Tensor or value.device != device:
            return False
    return True


def _move(obj: Any, device: torch.device, move_tensor: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return move_tensor(obj)
    if _has_to_method(obj):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return rebuild_mapping(obj, {key: _move(value, device, move_tensor) for key, value in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_move(value, device, move_tensor) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(value, device, move_tensor) for value in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _move_dataclass(obj, device, move_tensor)
    return obj


def holds_tensor(obj: Any) -> bool:
    """Whether `obj` is a tensor or holds one, in the containers `move_to_device` walks (dicts and
    other mappings, lists, tuples, namedtuples, dataclasses)."""
    if isinstance(obj, Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(holds_tensor(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_tensor(value) for value in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(holds_tensor(getattr(obj, field.name)) for field in dataclasses.fields(obj))
    return False


def _has_to_method(obj: Any) -> bool:
    return not isinstance(obj, type) and callable(getattr(obj, "to", None))


def rebuild_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """A mapping of `original`'s type holding `items`."""
    kind = type(original)
    if kind is dict:
        return items
    if isinstance(original, defaultdict):
        rebuilt: defaultdict[Any, Any] = kind(original.default_factory)
        rebuilt.update(items)
        return rebuilt
    return kind(items)


def _move_dataclass(obj: Any, device: torch.device, move_tensor: Callable[[Tensor], Tensor]) -> Any:
    """A copy of dataclass instance `obj` with its fields moved; its `__init__` does not run
    again, so frozen dataclasses and fields with `init=False` keep working."""
    moved = copy.copy(obj)
    for field in dataclasses.fields(obj):
        object.__setattr__(moved, field.name, _move(getattr(obj, field.name), device, move_tensor))
    return moved


def collective_input(data: Any, device: torch.device, numbers: bool = True,
                     move: Callable[[Tensor], Tensor] | None = None) -> Any:
    """`data` with every tensor on `device` and, with `numbers=True`, Python numbers as tensors.

    Containers (dicts, lists, tuples, namedtuples) keep their structure; other objects are
    returned unchanged. A `bool` becomes an int64 0 or 1, so that a sum counts the ranks where it
    was true and a mean gives their fraction. `move` puts a tensor that is elsewhere on `device`
    (the strategy's way, e.g. XLA's, which sends small values as data; `.to(device)` by default).
    """
    to_device = move or (lambda tensor: tensor.to(device))
    if type(data) is Tensor:
        return data if data.device == device else to_device(data)
    return tree_map(lambda leaf: _leaf_for_collective(leaf, device, numbers, to_device), data)


def _leaf_for_collective(leaf: Any, device: torch.device, numbers: bool,
                         to_device: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(leaf, Tensor):
        return leaf if leaf.device == device else to_device(leaf)
    if not numbers:
        return leaf
    if isinstance(leaf, bool):
        return to_device(torch.tensor(int(leaf)))
    if isinstance(leaf, (int, float)):
        return to_device(torch.tensor(leaf))
    return leaf
