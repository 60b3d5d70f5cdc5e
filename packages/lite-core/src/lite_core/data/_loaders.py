"""The dataloaders one `LightningLite` set up: what `setup_dataloaders` does to each loader (shard
it for training or evaluation, cut its global batch with `split_batches`, seed its workers, wrap
it to move batches to the device).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from lite_core.data import _sharding as _data
from lite_core.data._evaluation import EvaluationPasses, check_sharding
from lite_core.data._lite_loader import LiteDataLoader
from lite_core.errors import MisuseError
from lite_core.seed import seed_for_samplers
from lite_core.training._models import Claims, require_environment

if TYPE_CHECKING:
    from lite_core.strategies.strategy import Strategy


class Loaders:
    """`LightningLite`'s set-up dataloaders: each claimed once, sharded for its strategy."""

    def __init__(self, strategy: Strategy, claims: Claims, evaluations: EvaluationPasses) -> None:
        self._strategy = strategy
        self._claims = claims
        self._evaluations = evaluations

    def setup(self, dataloaders: tuple[DataLoader, ...], replace_sampler: bool, move_to_device: bool,
              sharding: str, split_batches: bool) -> Any:
        """`LightningLite.setup_dataloaders`: each loader set up (one alone, several as a tuple)."""
        check_sharding(sharding)
        check_split_batches(split_batches, replace_sampler)
        require_environment(self._strategy, "setup_dataloaders")
        wrapped = [self._setup_one(d, replace_sampler, move_to_device, sharding, split_batches) for d in dataloaders]
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def _setup_one(self, dataloader: DataLoader, replace_sampler: bool, move_to_device: bool, sharding: str,
                   split_batches: bool) -> LiteDataLoader:
        if isinstance(dataloader, LiteDataLoader):
            raise MisuseError("This dataloader was already set up by Lite: set up each dataloader once and reuse"
                              " the result.")
        return setup_dataloader(self._strategy, self._claims, self._evaluations, dataloader, replace_sampler,
                                move_to_device, sharding, split_batches)


def check_split_batches(split_batches: bool, replace_sampler: bool) -> None:
    """Refuse `split_batches=True` with `replace_sampler=False`, before any loader is touched."""
    if split_batches and not replace_sampler:
        raise MisuseError(
            "setup_dataloaders(split_batches=True) cuts the batches Lite draws, but replace_sampler=False"
            " keeps your own sampler: pass one of the two."
        )


def setup_dataloader(strategy: Strategy, claims: Claims, evaluations: EvaluationPasses,
                     dataloader: DataLoader, replace_sampler: bool, move_to_device: bool,
                     sharding: str, split_batches: bool) -> LiteDataLoader:
    """One loader of `LightningLite.setup_dataloaders`, set up under `strategy`."""
    if not isinstance(dataloader, DataLoader):
        raise MisuseError(
            f"setup_dataloaders() takes torch DataLoaders but got {type(dataloader).__name__}: wrap"
            " your data in a torch.utils.data.DataLoader."
        )
    claims.claim(dataloader, "dataloader")
    shard = strategy.distributed_sampler_kwargs()
    evaluation = None
    seed = seed_for_samplers()
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
