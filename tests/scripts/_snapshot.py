"""A user's in-memory snapshot, shared by `sharded_train.py` (fsdp, 2 processes) and
`fsdp_single_process.py` (fsdp, 1 process): `best = lite.full_state_dict(model)` taken before a
training step must still hold the weights and running statistics of before the step, as it does
under `ddp` (a copy), and as on a GPU, where the gathered weights land in host memory anyway.

`taken_before_a_step(lite)` returns, on rank 0, the entries the snapshot lost (changed since it
was taken) and the entries the step left as they were (none may, or the check would prove
nothing).
"""

from __future__ import annotations

import torch
from torch import nn

from lite_core import LightningLite


def taken_before_a_step(lite: LightningLite) -> tuple[list[str], list[str]]:
    torch.manual_seed(3)
    model = lite.setup_module(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    optimizer = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    snapshot = lite.full_state_dict(model)
    as_taken = {name: value.clone() for name, value in snapshot.items()}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(lite.global_rank))
    lite.backward(model(x).square().mean())  # train mode: BatchNorm updates its running statistics
    optimizer.step()
    after = lite.full_state_dict(model)
    lost = [name for name in as_taken if not torch.equal(snapshot[name], as_taken[name])]
    unchanged = [name for name in as_taken if torch.equal(after[name], as_taken[name])]
    return lost, unchanged
