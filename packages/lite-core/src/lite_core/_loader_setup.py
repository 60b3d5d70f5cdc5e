"""Setting up dataloaders: what `LightningLite.setup_dataloaders` does to each loader (shard it
for training or evaluation, cut its global batch with `split_batches`, seed its workers, wrap it
to move batches to the device).
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from lite_core import _data
from lite_core._loader import LiteDataLoader
from lite_core._setup import claim
from lite_core.errors import MisuseError

if TYPE_CHECKING:
    from lite_core._evaluation import EvaluationPasses
    from lite_core.strategies.strategy import Strategy


def check_split_batches(split_batches: bool, replace_sampler: bool) -> None:
    """Refuse `split_batches=True` with `replace_sampler=False`, before any loader is touched."""
    if split_batches and not replace_sampler:
        raise MisuseError(
            "setup_dataloaders(split_batches=True) cuts the batches Lite draws, but replace_sampler=False"
            " keeps your own sampler: pass one of the two."
        )


def setup_dataloader(strategy: Strategy, set_up: weakref.WeakSet[Any], evaluations: EvaluationPasses,
                     dataloader: DataLoader, replace_sampler: bool, move_to_device: bool,
                     sharding: str, split_batches: bool) -> LiteDataLoader:
    """One loader of `LightningLite.setup_dataloaders`, set up under `strategy`."""
    if not isinstance(dataloader, DataLoader):
        raise MisuseError(
            f"setup_dataloaders() takes torch DataLoaders but got {type(dataloader).__name__}: wrap"
            " your data in a torch.utils.data.DataLoader."
        )
    claim(set_up, dataloader, "dataloader")
    shard = strategy.distributed_sampler_kwargs()
    evaluation = None
    seed = int(os.environ.get("LITE_GLOBAL_SEED", 0))
    if replace_sampler and shard is not None:
        evaluation = evaluations.shard(dataloader, shard, seed, sharding)
        if sharding == "evaluation":
            dataloader = dataloader if evaluation is None else evaluation.dataloader
        elif split_batches:
            dataloader = _data.split_batches(dataloader, strategy.split_batch_part, shard["num_replicas"])
        else:
            dataloader = _data.distribute(dataloader, shard["num_replicas"], shard["rank"], seed)
    elif replace_sampler:
        within = strategy.evaluation_sampler_kwargs()  # e.g. one replica group's processes
        if within is not None:
            evaluation = evaluations.shard(dataloader, within, seed, sharding)
        dataloader = _data.in_order(dataloader)
    if split_batches and shard is None and strategy.is_distributed and not strategy.take_global_batches(dataloader):
        raise MisuseError(
            f"setup_dataloaders(split_batches=True) cannot cut batches under strategy {strategy.name!r},"
            " which leaves its loaders unsharded: use that strategy's own option for a global batch if it"
            " has one, or leave split_batches out."
        )
    dataloader = _data.with_worker_seeding(dataloader, strategy.global_rank)
    if evaluation is not None and evaluation.dataloader is not dataloader:
        _data.with_worker_seeding(evaluation.dataloader, strategy.global_rank)
    moves_plainly = strategy.moves_batches_plainly
    return LiteDataLoader(dataloader, strategy if move_to_device else None, evaluation, moves_plainly)
