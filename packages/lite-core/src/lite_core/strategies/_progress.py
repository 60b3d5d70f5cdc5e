"""Names the rank that never arrived when a collective times out.

Every rank counts the Lite collectives it enters (`barrier`, `broadcast`, `all_gather`,
`all_reduce`). A daemon thread publishes the count to the process group's store at most every
`interval` seconds and only when it changed, so a call costs a counter increment, not a network
round trip. When a collective times out, the rank reads every rank's published count and says
which ranks are behind.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, TypeVar

from lite_core.errors import CollectiveTimeoutError

T = TypeVar("T")

_KEY = "lite/collectives/{rank}"
#: Seconds between two publications of this rank's progress.
PUBLISH_INTERVAL = 0.25
#: How many lagging ranks a message names before it says "and N more".
_NAMED_AT_MOST = 8


class CollectiveProgress:
    """This rank's count of Lite collectives, shared through `store` for timeout messages."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: timedelta,
                 interval: float = PUBLISH_INTERVAL) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._timeout = timeout
        self._interval = interval
        self._count = 0
        self._last: tuple[int, str] = (0, "")
        self._closed = threading.Event()
        store.set(_KEY.format(rank=rank), "0 ")  # before any collective: every rank's key exists
        self._thread = threading.Thread(target=self._publish, name="lite-collective-progress", daemon=True)
        self._thread.start()

    def run(self, name: str, collective: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call `collective(*args, **kwargs)` as Lite collective `name`; a timeout names the late ranks."""
        self._count += 1
        count = self._count
        self._last = (count, name)
        try:
            return collective(*args, **kwargs)
        except RuntimeError as err:
            if not _is_timeout(err):
                raise
            raise CollectiveTimeoutError(self._describe_timeout(name, count)) from err

    def close(self) -> None:
        """Stop publishing (before the process group and its store go away)."""
        self._closed.set()
        self._thread.join(timeout=2 * self._interval + 1)

    def _publish(self) -> None:
        # What `__init__` put in the store, not `self._last`: on a busy machine this thread may
        # first run after a collective, whose progress it would then take as published already.
        published: tuple[int, str] = (0, "")
        while not self._closed.wait(self._interval):
            last = self._last
            if last == published:
                continue
            try:
                self._store.set(_KEY.format(rank=self._rank), f"{last[0]} {last[1]}")
            except Exception:  # the store's host is gone: the job is ending anyway
                return
            published = last

    def _describe_timeout(self, name: str, count: int) -> str:
        self._closed.wait(2 * self._interval)  # let ranks that arrived in time publish it
        seconds = f"{self._timeout.total_seconds():g}"
        head = f"{name} #{count} timed out after {seconds} s on rank {self._rank}"
        fix = ("make every rank call the same collectives in the same order, or raise LITE_COLLECTIVE_TIMEOUT"
               " (or the strategy's timeout)")
        others = self._read_others()
        if others is None:
            return f"{head} and the other ranks' progress could not be read: {fix}."
        late = {rank: last for rank, last in others.items() if last[0] < count}
        if late:
            return f"{head}: {_late_ranks(late)} did not arrive; {fix}."
        elsewhere = {rank: last for rank, last in others.items() if last != (count, name)}
        if elsewhere:
            where = ", ".join(f"rank {r} is in {n} #{c}" for r, (c, n) in sorted(elsewhere.items())[:_NAMED_AT_MOST])
            return f"{head} while {where}; {fix}."
        return f"{head} although every rank arrived (a slow or stuck peer or network): {fix}."

    def _read_others(self) -> dict[int, tuple[int, str]] | None:
        others = {}
        try:
            for rank in range(self._world_size):
                if rank == self._rank:
                    continue
                key = _KEY.format(rank=rank)
                raw = self._store.get(key).decode() if self._store.check([key]) else "0 "
                count, _, last_name = raw.partition(" ")
                others[rank] = (int(count), last_name)
        except Exception:  # the store's host is gone or unreachable
            return None
        return others


def _late_ranks(late: dict[int, tuple[int, str]]) -> str:
    named = sorted(late.items())[:_NAMED_AT_MOST]
    parts = [f"{rank} ({f'last in {n} #{c}' if c else 'no collective yet'})" for rank, (c, n) in named]
    more = f" and {len(late) - len(named)} more" if len(late) > len(named) else ""
    return f"rank{'s' if len(late) > 1 else ''} {', '.join(parts)}{more}"


def _is_timeout(err: RuntimeError) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text
