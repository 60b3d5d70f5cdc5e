"""The process group Lite builds: a store of its own attempt, and a group that exists already.

The restart itself is tested for real under torchrun in tests/integration/elastic; here the
token handshake meets a store full of an earlier attempt's keys, and a group created before
Lite (as Ray Train does) is reused and left alive.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lite_core.strategies import process_group


def test_every_rank_gets_the_fresh_token_although_the_store_holds_an_earlier_attempts(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    store = dist.HashStore()
    base = "lite/run=job/attempt-handshake"
    for rank in (1, 2):  # what the previous attempt's ranks left behind: their questions and answers
        store.set(f"{base}/ask/{rank}", f"old-nonce-{rank}")
        store.set(f"{base}/answer/old-nonce-{rank}", "old-token")
    tokens: dict[int, str] = {}

    def join(rank: int) -> None:
        tokens[rank] = process_group._agree_on_token(store, rank, 3, timedelta(seconds=20))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (2, 1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert set(tokens) == {0, 1, 2}
    assert tokens[0] == tokens[1] == tokens[2] != "old-token"


def test_the_prefix_names_only_what_every_rank_of_the_attempt_shares(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # differs between nodes of one round
    assert process_group.attempt_prefix(4, "abc") == "lite/run=job/world=4/token=abc/"
    monkeypatch.setenv("LITE_RESTART_COUNT", "2")  # differs between nodes of one round too
    assert process_group.attempt_prefix(4) == "lite/world=4/"


REUSE = textwrap.dedent("""
    import atexit
    import torch, torch.distributed as dist
    from lite_core import LightningLite

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    theirs = dist.group.WORLD
    # Runs after Lite's own teardown at exit (atexit is last in, first out): the group must live.
    atexit.register(lambda: print("alive after Lite's teardown:", dist.is_initialized()))

    def train(lite):
        assert dist.group.WORLD is theirs, "Lite replaced the group"
        return lite.all_reduce(torch.tensor(3.0), reduce_op="sum").item()

    print(LightningLite(accelerator="cpu", strategy="ddp", devices=1).launch(train))
""")


@pytest.mark.timeout(120)
def test_a_group_that_exists_is_reused_and_left_to_its_owner(run_script, output_of):
    proc = run_script(command=[sys.executable, "-c", REUSE])
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.splitlines() == ["3.0", "alive after Lite's teardown: True"]


# One rank of a 2-process group with a 1 s collective timeout; rank 1 starts 4 s late, as a new
# process importing torch on a busy machine may. Once both are in, rank 1 skips a second
# all_reduce: rank 0's must still time out after about 1 s. Rank 0 then leaves with os._exit:
# gloo does not cancel a timed-out collective, and tearing the group down at interpreter exit
# while its worker thread still waits on rank 1 aborts the process (seen about once in 6 runs).
LATE_RANK = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from lite_core.strategies.process_group import init_attempt_process_group

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    if rank == 1:
        time.sleep(4.0)
    init_attempt_process_group("gloo", "127.0.0.1", port, rank, 2, timedelta(seconds=1))
    dist.all_reduce(torch.ones(1))
    print("joined", flush=True)
    if rank == 1:
        time.sleep(8.0)  # absent from the next collective, but alive
    else:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError:
            print(f"timed out after {time.monotonic() - start:.1f} s", flush=True)
        os._exit(0)
""")


@pytest.mark.timeout(60)
def test_a_rank_that_starts_later_than_the_collective_timeout_still_joins(free_tcp_port):
    port = str(free_tcp_port())
    ranks = [subprocess.Popen([sys.executable, "-c", LATE_RANK, str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=45) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    (joined, timed_out), (joined_too,) = (out.split("\n")[:-1] for out, _ in outputs)
    assert joined == joined_too == "joined"
    # Forming the group waited for the late rank; a collective still waits only the 1 s asked.
    assert float(timed_out.split()[3]) < process_group.MIN_JOIN_SECONDS / 10, timed_out
