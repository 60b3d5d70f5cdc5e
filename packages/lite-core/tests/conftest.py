"""lite-core's tests see only the core's own entry points and the fake backend's.

The backend environments (`test-deepspeed`, `test-xla`, `test-cuda`) install real backends next
to the core; the registry and connector tests assert how the core behaves when a known backend
is NOT installed, so every core test runs with the installed real backends hidden from the
registry (tests that install a backend under `tmp_path` still find it).
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pytest

from lite_core import _registry

#: The distributions of Lite's real backends (the core names them in its install hints).
_REAL_BACKENDS = frozenset({"lite-cuda", "lite-xla", "lite-deepspeed"})


def _distribution_name(entry_point: EntryPoint) -> str:
    dist = entry_point.dist
    return "" if dist is None else str(dist.metadata["Name"]).lower().replace("_", "-")


def _without_real_backends(**selection: Any) -> list[EntryPoint]:
    return [ep for ep in entry_points(**selection) if _distribution_name(ep) not in _REAL_BACKENDS]


@pytest.fixture(autouse=True)
def _core_only_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_registry, "entry_points", _without_real_backends)
    _registry.clear_cache()
    yield
    _registry.clear_cache()
