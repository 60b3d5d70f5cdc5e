"""Replica 0 waits in a barrier that replica 1, asleep, never joins: the moment to stop a job.

    python waiting_replicas.py OUT_DIR

Each replica writes `OUT_DIR/ready_rank{r}` once running. The test then signals the launching
process alone; every replica process must end within seconds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # also runs in torch-xla's spawned process
    import _cpu_harness

    _cpu_harness.install()

from lite_core import LightningLite


class Job(LightningLite):
    def run(self, out_dir: str) -> int:
        Path(out_dir, f"ready_rank{self.global_rank}").write_text(str(os.getpid()))
        if self.global_rank == 1:
            time.sleep(300)
        self.barrier()
        return 0


if __name__ == "__main__":
    import _cpu_harness  # its settings are for XLA's CPU device only
    from lite_xla.strategies.xla import XLAStrategy

    Job(accelerator="tpu", strategy=XLAStrategy(**_cpu_harness.STRATEGY_KWARGS), devices=2).run(sys.argv[1])
