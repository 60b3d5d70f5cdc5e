"""Collectives as a user's loop calls them (Python numbers, nested containers, mismatched shapes),
shared by the 2-process scripts `collectives.py` (ddp, ddp_spawn, ddp_fork) and `sharded_train.py`
(fsdp), so no strategy needs a job of its own.

`record(lite)` returns what this rank saw, as JSON: each tensor as
`{"tensor": values, "dtype": ..., "device": ...}`; the root conftest's `check_user_collectives`
fixture holds what every rank must have seen.
"""

from __future__ import annotations

from typing import Any

import torch

from lite_core import LightningLite
from lite_core.errors import MisuseError


def describe(value: Any) -> Any:
    """`value` as JSON, with each tensor's values, dtype and device."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist(), "dtype": str(value.dtype), "device": str(value.device)}
    if isinstance(value, dict):
        return {key: describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return {"type": type(value).__name__, "items": [describe(item) for item in value]}
    return {"python": value, "type": type(value).__name__}


def mnist_style_test_loss(lite: LightningLite) -> Any:
    """The test loop of an MNIST example: a Python float summed over this rank's batches, then
    over the ranks."""
    test_loss = 0.0
    for batch in range(lite.global_rank, 4, lite.world_size):  # rank 0: batches 0, 2; rank 1: 1, 3
        test_loss += float(batch + 0.5)
    return lite.all_reduce(test_loss, reduce_op="sum")


def record(lite: LightningLite) -> dict[str, Any]:
    """What this rank's collectives returned."""
    rank = lite.global_rank
    seen: dict[str, Any] = {"device": str(lite.device)}
    seen["mnist_test_loss"] = describe(mnist_style_test_loss(lite))
    seen["float_sum"] = describe(lite.all_reduce(rank + 1.0, reduce_op="sum"))
    seen["int_mean"] = describe(lite.all_reduce(rank * 2, reduce_op="mean"))
    seen["bool_sum"] = describe(lite.all_reduce(rank == 0, reduce_op="sum"))
    seen["float_gather"] = describe(lite.all_gather(rank + 0.5))
    nested = {"loss": 0.5 * (rank + 1), "parts": [torch.tensor([rank, 1]), 2], "pair": (rank, 1.5)}
    seen["nested_reduce"] = describe(lite.all_reduce(nested, reduce_op="sum"))
    seen["nested_gather"] = describe(lite.all_gather({"x": torch.tensor([rank]), "n": [rank * 10, 0.5]}))
    seen["broadcast_number"] = describe(lite.broadcast(rank + 10, src=1))
    seen["broadcast_tensor"] = describe(lite.broadcast({"t": torch.tensor([rank + 1.0]), "k": "v"}, src=0))
    try:
        lite.all_gather(torch.zeros(rank + 1, 2))
        seen["mismatch_error"] = None
    except MisuseError as err:
        seen["mismatch_error"] = str(err)
    seen["after_mismatch"] = describe(lite.all_reduce(1.0, reduce_op="sum"))  # the job goes on
    return seen
