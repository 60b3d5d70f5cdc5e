"""The tensor-parallel plan of the GPT in `data_and_model.py`, shared by `train_tp.py` (Lite) and
`train_tp_plain.py` (plain PyTorch): in every block the query, key, value and first MLP projections
are split by output features (column-wise, so each process holds whole attention heads) and the
attention output and second MLP projections by input features (row-wise, whose partial results
are summed); then FSDP2 shards every block and the rest of the model over the data dimension."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

PLAN = {
    "attention.query": ColwiseParallel(),
    "attention.key": ColwiseParallel(),
    "attention.value": ColwiseParallel(),
    "attention.out": RowwiseParallel(),
    "mlp.0": ColwiseParallel(),
    "mlp.2": RowwiseParallel(),
}


def parallelize(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Tensor parallel over `device_mesh["tensor_parallel"]`, FSDP2 over `device_mesh["data_parallel"]`."""
    for block in model.blocks:
        parallelize_module(block, device_mesh["tensor_parallel"], PLAN)
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])
