"""`LightningLite.profile()`: torch's profiler on chosen ranks, one Chrome trace per rank."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from lite_core.errors import ConfigurationError


#: The profilers that `profile()` runs in this process, innermost last: a `ThroughputMonitor`'s
#: `step()` marks a step of the innermost one.
active_profiles: list[Any] = []


class _NoProfiler:
    """What `profile()` gives a rank that is not profiled: `step()` does nothing."""

    def step(self) -> None:
        pass


@contextmanager
def profile(rank: int, folder: str | os.PathLike[str], ranks: Iterable[int] | None, wait: int, warmup: int,
            active: int, repeat: int, **profiler_kwargs: Any) -> Iterator[Any]:
    """The body of `LightningLite.profile` for the process of global rank `rank`."""
    for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1), ("repeat", repeat, 1)):
        if not isinstance(value, int) or value < least:
            raise ConfigurationError(f"profile() got {name}={value!r}: pass an int of at least {least}.")
    if ranks is not None and rank not in set(ranks):
        yield from _active(_NoProfiler())
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
        yield from _active(prof)


def _active(prof: Any) -> Iterator[Any]:
    """Yield `prof`, registered in `active_profiles` while the block runs."""
    active_profiles.append(prof)
    try:
        yield prof
    finally:
        active_profiles.remove(prof)
