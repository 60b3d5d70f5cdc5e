"""What each script here ends with: rank 0 writes what `run` returned as JSON, for the test to read."""

from __future__ import annotations

import json
from typing import Any


def write(lite: Any, result: Any, path: str) -> None:
    """On global rank 0 of `lite`, write `result` to `path` as JSON; the other ranks write nothing."""
    if lite.is_global_zero:
        with open(path, "w") as handle:
            json.dump(result, handle)
