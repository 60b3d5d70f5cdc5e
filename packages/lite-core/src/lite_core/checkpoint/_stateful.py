"""What counts as stateful: saved as its `state_dict()`, restored with `load_state_dict()`.

At the ground, so that the set-up loader's position (`_position`) and the checkpoint code
(`checkpoint._state`) share one rule without the data layer importing the checkpoint layer.
"""

from __future__ import annotations

from typing import Any


def is_stateful(value: Any) -> bool:
    """Whether `value` is saved as its `state_dict()` and restored with `load_state_dict()`."""
    if isinstance(value, type):  # a class has the methods, but unbound
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
