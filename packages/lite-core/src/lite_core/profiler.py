"""`LightningLite.profile()`: torch's profiler on chosen ranks, one Chrome trace per rank."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from lite_core.errors import ConfigurationError


class Profiles:
    """The profilers that one `LightningLite`'s `profile()` blocks run, innermost last: its
    `ThroughputMonitor`'s `step()` marks a step of the innermost one (`step`)."""

    def __init__(self) -> None:
        self._running: list[Any] = []

    def step(self) -> None:
        """Mark a step of the innermost running profiler, if any."""
        if self._running:
            self._running[-1].step()

    @contextmanager
    def running(self, prof: Any) -> Iterator[Any]:
        """Yield `prof`, the innermost running profiler while the block runs."""
        self._running.append(prof)
        try:
            yield prof
        finally:
            self._running.remove(prof)


class _NoProfiler:
    """What `profile()` gives a rank that is not profiled: `step()` does nothing."""

    def step(self) -> None:
        pass


@contextmanager
def profile(profiles: Profiles, rank: int, folder: str | os.PathLike[str], ranks: Iterable[int] | None, wait: int,
            warmup: int, active: int, repeat: int, **profiler_kwargs: Any) -> Iterator[Any]:
    """The body of `LightningLite.profile` for the process of global rank `rank`, run in `profiles`."""
    for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1), ("repeat", repeat, 1)):
        if not isinstance(value, int) or value < least:
            raise ConfigurationError(f"profile() got {name}={value!r}: pass an int of at least {least}.")
    if ranks is not None and rank not in set(ranks):
        with profiles.running(_NoProfiler()) as prof:
            yield prof
        return
    import torch.profiler

    os.makedirs(folder, exist_ok=True)
    cycles = 0

    def write_trace(prof: torch.profiler.profile) -> None:
        nonlocal cycles
        cycles += 1
        suffix = f"-{cycles}" if repeat > 1 else ""
        prof.export_chrome_trace(os.path.join(os.fspath(folder), f"trace-rank{rank}{suffix}.json"))

    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)
    with torch.profiler.profile(schedule=schedule, on_trace_ready=write_trace, **profiler_kwargs) as prof:
        with profiles.running(prof):
            yield prof
