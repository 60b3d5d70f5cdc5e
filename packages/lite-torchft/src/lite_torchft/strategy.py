"""`strategy="ddp_ft"`: DDP inside each replica group, fault-tolerant replication across groups."""

from __future__ import annotations

from torch import nn

from lite_core.plugins import DDPStrategy, Precision
from lite_torchft._replication import FaultTolerantReplication


class DDPFTStrategy(FaultTolerantReplication, DDPStrategy):
    """`strategy="ddp_ft"`: per-step fault tolerance across replica groups on torchft.

    Takes `FaultTolerantReplication`'s arguments (`ft_timeout`, `quorum_timeout`,
    `connect_timeout`, `min_replica_size`, `max_commit_failures`; `split_batches` is deprecated) and `strategy="ddp"`'s
    (`timeout`, `process_group_backend`, DDP's keyword arguments) for the group.
    """

    name = "ddp_ft"

    def _group_module(self, module: nn.Module, precision: Precision) -> nn.Module:
        # a group of one process has nothing to synchronise inside it: no DDP wrapper, no
        # all-reduce over a one-rank group before the one across groups
        return module if self.world_size == 1 else super()._group_module(module, precision)
