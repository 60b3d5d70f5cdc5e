"""The store a process group is built on, scoped to one attempt of the job.

A launcher that restarts workers may keep the rendezvous store alive between attempts: torchrun's
agent hosts one TCPStore for the whole job (`TORCHELASTIC_USE_AGENT_STORE=True`) and hands every
attempt the same `MASTER_ADDR`/`MASTER_PORT`. A group built on that store unscoped reads the
previous attempt's keys (gloo's peer addresses, the start-up barrier's counters), so restarted
workers connect to dead peers ("Gloo connectFullMesh failed ... Connection refused"). Wrapping
the store in a `PrefixStore` that names the attempt gives every attempt a key space of its own.

What could name an attempt, read from torch 2.13's agent (`elastic/agent/server/api.py`,
`local_elastic_agent.py`, `rendezvous/dynamic_rendezvous.py`):

- `TORCHELASTIC_RESTART_COUNT` is `max_restarts - remaining_restarts` of *this node's* agent. A
  restart for a membership change (`num_nodes_waiting() > 0`) does not count. So two rounds can
  share a count, and, worse, the nodes of one round can disagree: when a worker dies on node B,
  B's agent counts a failure while A's agent, whose workers still look healthy, sees B waiting
  and restarts for "membership" without counting (measured on loopback: A got 0, B got 1).
- The rendezvous round, which every agent of a round agrees on, is not exported to the workers.
- `WORLD_SIZE` and `TORCHELASTIC_RUN_ID` are the same for every worker of a round but repeat.

No exported value names the round for every node alike, so under the agent's store global rank 0
mints a fresh token for the attempt and hands it to each rank in answer to a fresh nonce of that
rank (`_agree_on_token`): a rank can only ever read an answer to its own question, so no key of an
earlier attempt is taken for this one. The prefix is run id, world size and the token. Where rank
0 hosts the store (Lite's launchers, SLURM, the agent with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`,
which `lite run` sets for a job of several nodes) each attempt's store is new; the prefix there
names only the world size, and needs no token: a restart count there would split the ranks of one
round whose nodes counted differently, so that each waits for peers under a prefix of its own.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

#: How often rank 0 looks for ranks waiting for the attempt's token.
_POLL_SECONDS = 0.01

#: The least time forming the process group waits for every rank, whatever the collective
#: timeout: a rank is a new process that imports torch first, which on a busy machine can take
#: longer than a short collective timeout (seconds).
MIN_JOIN_SECONDS = 60.0


def join_timeout(timeout: timedelta) -> timedelta:
    """How long forming the group waits for the ranks: `timeout`, but at least `MIN_JOIN_SECONDS`."""
    return max(timeout, timedelta(seconds=MIN_JOIN_SECONDS))


def attempt_prefix(world_size: int, token: str = "") -> str:
    """The key prefix that keeps this attempt's process group apart from earlier attempts'.

    Only values that every rank of the attempt shares go in: the restart counts of torch's agents
    may differ between nodes, so they stay out.

    Args:
        world_size: the number of processes in this attempt's group.
        token: what the ranks agreed on for this attempt (empty where the store is new anyway).

    Returns:
        e.g. `"lite/run=job7/world=4/token=5f0c.../"`, or `"lite/world=4/"` without a token.
    """
    if token:
        return f"lite/run={os.environ.get('TORCHELASTIC_RUN_ID', '').strip() or 'none'}/world={world_size}/token={token}/"
    return f"lite/world={world_size}/"


def uses_agent_store() -> bool:
    """Whether a launcher's agent hosts the store at `MASTER_ADDR:MASTER_PORT` (torchrun does)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"


def attempt_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """A store for this attempt's process group, on `address:port`.

    Under torchrun's agent (`TORCHELASTIC_USE_AGENT_STORE=True`) every worker connects to the
    agent's store as a client and the ranks agree on a fresh token for the attempt; otherwise
    global rank 0 hosts a new store. Either way the store is wrapped in a `PrefixStore` named by
    `attempt_prefix`, so keys left by an earlier attempt are never seen. Every rank must call it.

    Args:
        address: the host that serves the store (`MASTER_ADDR`).
        port: its port (`MASTER_PORT`).
        rank: this process's global rank.
        world_size: the number of processes in the group.
        timeout: how long to wait for the store and for keys in it; at least `MIN_JOIN_SECONDS`
            (`join_timeout`), so a short collective timeout does not cut the ranks' start short.

    Returns:
        The store to pass to `torch.distributed.init_process_group(store=...)`.
    """
    shared = uses_agent_store()
    hosts = rank == 0 and not shared
    timeout = join_timeout(timeout)
    store = dist.TCPStore(address, port, world_size, is_master=hosts, timeout=timeout, multi_tenant=hosts)
    token = _agree_on_token(store, rank, world_size, timeout) if shared else ""
    return dist.PrefixStore(attempt_prefix(world_size, token), store)


def _agree_on_token(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """Rank 0's fresh token for this attempt, known to every rank.

    Each other rank writes a fresh nonce under its rank and waits for the answer filed under that
    nonce; rank 0 answers whatever nonce it finds (a stale one costs a useless key) until every
    rank has confirmed under the new token."""
    base = f"lite/run={os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/attempt-handshake"
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{base}/ask/{rank}", nonce)
        token = store.get(f"{base}/answer/{nonce}").decode()
        store.set(f"{base}/{token}/ready/{rank}", b"1")
        return token
    token = uuid.uuid4().hex
    waiting, answered = set(range(1, world_size)), set()
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        for other in sorted(waiting):
            if store.check([f"{base}/{token}/ready/{other}"]):
                waiting.discard(other)
            elif store.check([f"{base}/ask/{other}"]):
                nonce = store.get(f"{base}/ask/{other}").decode()
                if nonce not in answered:
                    store.set(f"{base}/answer/{nonce}", token)
                    answered.add(nonce)
        if not waiting:
            return token
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(waiting)} did not join the process group within {timeout}:"
                               " check that every node's launcher started them.")
        time.sleep(_POLL_SECONDS)
    return token


def init_attempt_process_group(backend: str, address: str, port: int, rank: int, world_size: int,
                               timeout: timedelta) -> None:
    """Create the default process group on `attempt_store`.

    Args:
        backend: the `torch.distributed` backend (`"gloo"`, `"nccl"`, ...).
        address: the host that serves the store (`MASTER_ADDR`).
        port: its port (`MASTER_PORT`).
        rank: this process's global rank.
        world_size: the number of processes in the group.
        timeout: how long a collective waits; the store waits `join_timeout(timeout)`.
    """
    store = attempt_store(address, port, rank, world_size, timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
