"""Fixtures for lite-torchft's tests (run them with `hatch run test-torchft:all`).

`lighthouse` starts torchft's lighthouse in the test process on a free loopback port, with short
timeouts, so that a killed replica group is dropped within a couple of seconds.
"""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """The address of a lighthouse that forms a quorum of one group or more."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    port = server.address().rsplit(":", 1)[1]
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
