"""`gather_for_metrics`: every process's rows, concatenated, each exactly once.

Processes may hold different numbers of rows, but a gather needs one shape on every process: the
row counts are gathered first, each tensor is padded to the largest count, gathered through the
strategy's own `all_gather` (so every backend's collectives serve, XLA's included), and each
process's part is cut back to its own rows. Processes that hold the same data (the same rank in
the strategy's `distributed_sampler_kwargs`, e.g. tensor-parallel peers) count once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lite_core.move import collective_input
from lite_core.errors import MisuseError

if TYPE_CHECKING:
    from lite_core.strategies.strategy import Strategy


def gather_for_metrics(data: Any, strategy: Strategy) -> Any:
    """`data`'s tensors concatenated over the processes along dim 0 (see `LightningLite.gather_for_metrics`)."""
    leaves, spec = tree_flatten(data)
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, bool, int, float)):
            raise MisuseError(
                f"gather_for_metrics() cannot send a value of type {type(leaf).__name__}: pass tensors, Python numbers,"
                " or dicts, lists and tuples of them."
            )
    moved = collective_input(leaves, strategy.root_device, move=strategy.batch_to_device)
    rows = [leaf.reshape(1) if leaf.dim() == 0 else leaf for leaf in moved]
    shard = strategy.distributed_sampler_kwargs()
    if shard is None or strategy.world_size == 1:
        return tree_unflatten([leaf.clone() for leaf in rows], spec)
    return tree_unflatten(_gathered(rows, shard["rank"], strategy), spec)


def _gathered(leaves: list[torch.Tensor], data_rank: int, strategy: Strategy) -> list[torch.Tensor]:
    """Each leaf's rows from every process that holds distinct data, in the order of their data ranks."""
    counts = torch.tensor([data_rank, *(leaf.shape[0] for leaf in leaves)], dtype=torch.int64)
    table = strategy.all_gather(collective_input(counts, strategy.root_device, move=strategy.batch_to_device))
    table = table.cpu().tolist()
    ranks = _one_process_per_data_rank([row[0] for row in table])
    return [_gathered_leaf(leaf, [row[1 + i] for row in table], ranks, strategy) for i, leaf in enumerate(leaves)]


def _one_process_per_data_rank(data_ranks: list[int]) -> list[int]:
    """The first process of each data rank, ordered by data rank."""
    first: dict[int, int] = {}
    for process, data_rank in enumerate(data_ranks):
        first.setdefault(data_rank, process)
    return [first[data_rank] for data_rank in sorted(first)]


def _gathered_leaf(leaf: torch.Tensor, counts: list[int], ranks: list[int], strategy: Strategy) -> torch.Tensor:
    longest = max(counts)
    if longest == 0:  # nobody has a row: nothing to send
        return leaf[:0].clone()
    padded = leaf
    if leaf.shape[0] < longest:
        padded = torch.cat([leaf, leaf.new_zeros((longest - leaf.shape[0], *leaf.shape[1:]))])
    parts = strategy.all_gather(padded)
    return torch.cat([parts[rank, : counts[rank]] for rank in ranks])
