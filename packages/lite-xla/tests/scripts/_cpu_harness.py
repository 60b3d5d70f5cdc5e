"""Test-only workarounds that let several XLA replicas run collectives on XLA's CPU device.

Never part of lite-xla: on TPUs none of this is needed. On a CPU host, `CPU_NUM_DEVICES=N`
runs the N replicas as threads of one process, and each thread compiles its own copy of every
graph; compiled separately, the copies get different collective operation ids and the
collectives abort after torch-xla's 10 s rendezvous timeout. The copies agree only when every
replica after the first finds the first one's executable in the compilation cache. So:

- at the step marker (`torch_xla.sync`, which `xm.mark_step`, the parallel loader and Lite all
  call) the replicas wait for each other; replica 0 compiles and launches its graph first, and
  the others launch theirs once replica 0's graph is in the compilation cache (compiled, or
  found there) or its step marker returned (nothing to run). A plain lock around the step marker is not
  enough: on CPU the step marker also runs the graph, so replica 0 would hold the lock while
  its collective waits for the others;
- `XLA_ENABLE_PARAM_ALIASING=0`: with the step graph's parameters aliased to its outputs
  (donated buffers), the second replica never reached the gradient all-reduce of the first
  training step (measured with 2 replicas on torch-xla 2.9.0);
- the replicas start one at a time: replica k runs its host code (`run()` up to its first step
  marker) only once replica k-1 has reached its own first step marker. The threads share torch's
  one global CPU random generator, so two `seed_everything(1)` + model constructions running at
  once interleave their draws, and rank 0's weights (which every replica starts from) come out
  different from a process's. Measured: about 1 run in 3 of the 2-replica parity test then
  started from other weights (step-0 loss 1.1674 instead of 1.0952; reproduced exactly by
  drawing W1(rank 0), W1(rank 1), b1, W2, b2 (rank 0), ... from one seeded generator). Separate
  processes, one per chip, each have their own generator;
- `XLA_THREAD_POOL_SIZE` >= N, so that no replica's execution waits for a free thread;
- the scripts pass `STRATEGY_KWARGS` (`pin_layout=False`) to the strategies (pinned layouts
  fail on CPU), and any
  rank-dependent value reaches the graph as tensor data, never as a Python constant (Lite's
  collectives already send 0-dim values as 1-element data).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

REPLICAS = int(os.environ.get("CPU_NUM_DEVICES", "1"))
#: What the scripts pass to `XLAStrategy`/`XLAFSDPStrategy` on XLA's CPU device only (pinned
#: layouts fail there); on TPUs the strategies keep torch-xla's default, `pin_layout=True`.
STRATEGY_KWARGS = {"pin_layout": False}
#: Extra wait after replica 0's graph entered the cache, for good measure.
_SETTLE_SECONDS = 0.05


def install() -> None:
    """Patch `torch_xla.sync` in this process (call at import time of the script)."""
    os.environ.setdefault("XLA_THREAD_POOL_SIZE", str(max(8, 2 * REPLICAS)))
    os.environ.setdefault("XLA_ENABLE_PARAM_ALIASING", "0")
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    original = torch_xla.sync
    everyone = threading.Barrier(REPLICAS, timeout=60)
    shared: dict[str, Any] = {}
    # started[k]: replica k reached its first step marker.
    started = [threading.Event() for _ in range(REPLICAS)]
    this_thread = threading.local()

    # torch-xla's thread runner calls `_init_world_size_ordinal()` at the start of each replica
    # thread, before the user's function: the one place to hold replica k back.
    original_init = xr._init_world_size_ordinal

    def init_in_turn() -> None:
        original_init()
        if getattr(this_thread, "gated", False):
            return
        this_thread.gated = True
        ordinal = xr.global_ordinal()
        if ordinal > 0 and not started[ordinal - 1].wait(timeout=60):
            raise RuntimeError(f"_cpu_harness: replica {ordinal - 1} never reached a step marker")

    xr._init_world_size_ordinal = init_in_turn

    def cached() -> tuple[int, Any]:
        # The compilation cache grows as soon as replica 0's graph is compiled, and the
        # cache-hit counter moves as soon as it found it there. (torch-xla's compile and execute
        # metrics are recorded only when the step marker returns, which on CPU can be after the
        # graph ran, i.e. never, while the others wait for them.)
        return (int(torch_xla._XLAC._xla_get_num_cached_compilation_graph()),
                met.counter_value("CachedCompile"))

    def serialised_sync(*args: Any, **kwargs: Any) -> None:
        if REPLICAS > 1 and not getattr(this_thread, "gated", False):
            raise RuntimeError("_cpu_harness: this replica thread did not start through"
                               " torch-xla's thread runner, so replicas may start together")
        ordinal = xr.global_ordinal()
        first = ordinal == 0
        started[ordinal].set()
        everyone.wait()
        if first:
            shared["done"], shared["before"] = threading.Event(), cached()
        everyone.wait()
        done, before = shared["done"], shared["before"]
        if first:
            try:
                original(*args, **kwargs)
            finally:
                done.set()
            return
        while not done.is_set() and cached() == before:
            time.sleep(0.005)
        if not done.is_set():
            time.sleep(_SETTLE_SECONDS)
        original(*args, **kwargs)

    torch_xla.sync = serialised_sync
