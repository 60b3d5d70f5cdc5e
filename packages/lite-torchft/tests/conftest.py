"""Fixtures for lite-torchft's tests (run them with `hatch run test-torchft:all`).

`lighthouse` starts torchft's lighthouse in the test process on a free loopback port, with a
short heartbeat timeout, so that a killed replica group is dropped within a second or two, and a
long join timeout (10 s): a quorum waits that long for a group that heartbeats but has not asked
yet, so that two groups released together meet in one quorum even on a busy machine (the tests
open a gate for both at once, see test_heal.py). `plain_run` runs `scripts/ft_train.py`'s plain
PyTorch loop in the test process.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable, Iterator

import pytest

FT_TRAIN = Path(__file__).parent / "scripts" / "ft_train.py"


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """The address of a lighthouse that forms a quorum of one group or more."""
    yield from _lighthouse(min_replicas=1)


@pytest.fixture
def lighthouse_of_two() -> Iterator[str]:
    """The address of a lighthouse whose every quorum holds both groups of a test that kills none.

    With one group enough, a group starved of the CPU for longer than the heartbeat timeout (1 s)
    is dropped from the next quorum and the other steps alone: a run then differs from the one
    process it is compared with for a reason that is the machine's load, not Lite's."""
    yield from _lighthouse(min_replicas=2)


def _lighthouse(min_replicas: int) -> Iterator[str]:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=10000,
                              heartbeat_timeout_ms=1000)
    port = server.address().rsplit(":", 1)[1]
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


@pytest.fixture
def plain_run() -> Callable[[Path], None]:
    """`plain_run(out)`: ft_train.py's plain PyTorch loop, run here; writes `out/weights-plain.pt`."""
    spec = importlib.util.spec_from_file_location("_ft_train", FT_TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.plain
