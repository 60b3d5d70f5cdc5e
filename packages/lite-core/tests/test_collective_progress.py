"""The message of a collective that timed out, built from every rank's progress in the store.

The ranks are simulated in one process on torch's in-memory `HashStore` (the real 2-process jobs
are in tests/integration/reliability/test_collective_timeouts.py); a "collective" here is a
function that raises gloo's timeout error.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lite_core.errors import CollectiveTimeoutError
from lite_core.strategies._progress import CollectiveProgress

INTERVAL = 0.01


def timed_out() -> None:
    raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete")


def ranks(world_size: int, store: Any = None) -> list[CollectiveProgress]:
    store = store if store is not None else dist.HashStore()
    return [CollectiveProgress(store, r, world_size, timedelta(seconds=5), interval=INTERVAL) for r in range(world_size)]


def published(store: Any, *expected: tuple[int, str]) -> None:
    """Wait until each `(rank, "count name")` is what that rank's thread published to `store`.

    The threads publish every INTERVAL, later under load: the tests wait on what the store holds,
    never on time (the 30 s deadline only guards against a hang: 3000x the idle interval).
    """
    deadline = time.monotonic() + 30
    for rank, progress in expected:
        while store.get(f"lite/collectives/{rank}") != progress.encode():
            assert time.monotonic() < deadline, f"rank {rank} never published {progress!r}"
            time.sleep(INTERVAL)


def message_of(progress: CollectiveProgress, name: str = "all_reduce") -> str:
    with pytest.raises(CollectiveTimeoutError) as info:
        progress.run(name, timed_out)
    return str(info.value)


def test_names_the_rank_that_did_not_arrive() -> None:
    store = dist.HashStore()
    zero, one = ranks(2, store)
    for p in (zero, one):
        p.run("barrier", lambda: None)
    zero.run("all_reduce", lambda: None)
    published(store, (1, "1 barrier"))
    assert message_of(zero) == (
        "all_reduce #3 timed out after 5 s on rank 0: rank 1 (last in barrier #1) did not arrive; make every"
        " rank call the same collectives in the same order, or raise LITE_COLLECTIVE_TIMEOUT (or the"
        " strategy's timeout)."
    )


def test_names_every_late_rank_and_those_without_any_collective() -> None:
    store = dist.HashStore()
    zero, one, two, three = ranks(4, store)
    for p in (zero, one, three):
        p.run("barrier", lambda: None)
    three.run("broadcast", lambda: None)
    published(store, (0, "1 barrier"), (1, "1 barrier"))
    message = message_of(three, "all_gather")
    assert message.startswith("all_gather #3 timed out after 5 s on rank 3: ranks 0 (last in barrier #1), 1 (last in"
                              " barrier #1), 2 (no collective yet) did not arrive; ")


def test_ranks_in_another_collective_are_named() -> None:
    store = dist.HashStore()
    zero, one = ranks(2, store)
    one.run("broadcast", lambda: None)
    published(store, (1, "1 broadcast"))
    assert message_of(zero, "barrier").startswith("barrier #1 timed out after 5 s on rank 0 while rank 1 is in broadcast #1; ")


def test_unreadable_store_still_gives_one_sentence() -> None:
    store = dist.HashStore()
    zero, _ = ranks(2, store)
    store.delete_key("lite/collectives/1")
    store.set("lite/collectives/1", "garbage")
    assert message_of(zero).startswith("all_reduce #1 timed out after 5 s on rank 0 and the other ranks' progress could"
                                       " not be read: make every rank")


def test_other_errors_pass_through_unchanged() -> None:
    (zero,) = ranks(1)

    def closed() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="^Connection closed by peer$"):
        zero.run("barrier", closed)
    assert zero.run("barrier", lambda: 7) == 7


def test_progress_is_published_only_by_the_thread_and_close_stops_it() -> None:
    store = dist.HashStore()
    (zero,) = ranks(1, store)
    zero.run("barrier", lambda: None)
    published(store, (0, "1 barrier"))
    zero.close()
    zero.run("all_reduce", lambda: None)
    time.sleep(5 * INTERVAL)
    assert store.get("lite/collectives/0") == b"1 barrier"


def test_a_collective_before_the_thread_first_runs_is_published(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a busy machine the publishing thread may first run after the first collective; its
    # progress must still reach the store (it once took it for published: CI's run at 24e3c76).
    held: list[threading.Thread] = []
    monkeypatch.setattr(threading.Thread, "start", lambda thread: held.append(thread))
    store = dist.HashStore()
    (zero,) = ranks(1, store)
    zero.run("barrier", lambda: None)
    monkeypatch.undo()
    held[0].start()  # the thread runs only now
    published(store, (0, "1 barrier"))
    zero.close()


def test_a_collective_costs_no_store_call() -> None:
    # The count is published by the thread alone: with it stopped, collectives touch no store
    # (a store call is a network round trip; the cost per call is measured in benchmarks/).
    class CountingStore(dist.HashStore):
        calls = 0

        def set(self, *args: Any) -> None:
            CountingStore.calls += 1
            super().set(*args)

    store = CountingStore()
    (zero,) = ranks(1, store)
    zero.close()
    before = CountingStore.calls
    for _ in range(1000):
        zero.run("all_reduce", lambda: None)
    assert CountingStore.calls == before