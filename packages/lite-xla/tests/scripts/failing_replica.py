"""Replica 1 raises in `run()` while replica 0 waits for it in a barrier.

    python failing_replica.py STAMP_FILE

Replica 1 writes the time it fails at to STAMP_FILE. The job must end with replica 1's error
and `ReplicaFailedError`, and leave no process behind.
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # also runs in torch-xla's spawned process
    import _cpu_harness

    _cpu_harness.install()

from lite_core import LightningLite


class Job(LightningLite):
    def run(self, stamp: str) -> int:
        if self.global_rank == 1:
            with open(stamp, "w") as handle:
                handle.write(str(time.time()))
            raise ValueError("replica one broke")
        self.barrier()
        return 0


if __name__ == "__main__":
    from lite_xla.strategies.xla import XLAStrategy

    # pin_layout=False is part of the CPU harness (see _cpu_harness.py).
    Job(accelerator="tpu", strategy=XLAStrategy(pin_layout=False), devices=2).run(sys.argv[1])
