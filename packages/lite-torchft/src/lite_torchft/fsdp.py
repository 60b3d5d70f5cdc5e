"""`strategy="fsdp_ft"`: FSDP2 inside each replica group, fault-tolerant replication across groups (HSDP)."""

from __future__ import annotations

from lite_core.plugins import FSDPStrategy
from lite_torchft._replication import FaultTolerantReplication


class FSDPFTStrategy(FaultTolerantReplication, FSDPStrategy):
    """`strategy="fsdp_ft"`: each group shards the model with `fully_shard`; rank r of every group
    averages its gradient shard with rank r of the other groups alive in the step (HSDP, as
    torchtitan builds it on torchft). Every group must have as many processes.

    Takes `FaultTolerantReplication`'s arguments and `strategy="fsdp"`'s for the group.
    """

    name = "fsdp_ft"
