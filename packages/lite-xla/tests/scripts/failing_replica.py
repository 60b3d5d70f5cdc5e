"""Replica 1 fails in `run()` while replica 0 waits for it in a barrier.

    python failing_replica.py STAMP_FILE [raise|exit|kill]

Replica 1 writes the time it fails at to STAMP_FILE, then raises (default), calls `os._exit(3)`
or sends its process SIGKILL. The job must end with `ReplicaFailedError` (after replica 1's
error when it raised) and leave no process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time

if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # also runs in torch-xla's spawned process
    import _cpu_harness

    _cpu_harness.install()

from lite_core import LightningLite


class Job(LightningLite):
    def run(self, stamp: str, how: str) -> int:
        if self.global_rank == 1:
            with open(stamp, "w") as handle:
                handle.write(str(time.time()))
            if how == "exit":
                os._exit(3)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("replica one broke")
        self.barrier()
        return 0


if __name__ == "__main__":
    import _cpu_harness  # its settings are for XLA's CPU device only
    from lite_xla.strategies.xla import XLAStrategy

    how = sys.argv[2] if len(sys.argv) > 2 else "raise"
    Job(accelerator="tpu", strategy=XLAStrategy(**_cpu_harness.STRATEGY_KWARGS), devices=2).run(sys.argv[1], how)
