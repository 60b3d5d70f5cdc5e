"""Sharding a dataloader across ranks keeps its settings (checked rank by rank in one process)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lite_core import LightningLite, seed_everything
from lite_core.data import _sharding
from lite_core.data._sharding import distribute, recording_loader_arguments
from lite_core.data._order import ShardedSampler
from lite_core.errors import MisuseError

DATA = list(range(10))


def _indexes(loader: DataLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch]


@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_are_disjoint_and_cover_the_data(drop_last: bool) -> None:
    shards = [_indexes(distribute(DataLoader(DATA, batch_size=1, drop_last=drop_last), 3, r, 0)) for r in range(3)]
    covered = sorted(i for shard in shards for i in shard)
    if drop_last:
        assert covered == DATA[:9]
    else:
        assert set(covered) == set(DATA)
        assert len({len(s) for s in shards}) == 1


def test_shuffle_is_kept_and_changes_with_epoch() -> None:
    loader = distribute(DataLoader(DATA * 10, shuffle=True, batch_size=100), 2, 0, seed=3)
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.shuffle
    first = _indexes(loader)
    loader.sampler.set_epoch(1)
    assert first != _indexes(loader)
    assert not distribute(DataLoader(DATA), 2, 0, 0).sampler.shuffle


def test_loader_settings_are_kept() -> None:
    original = DataLoader(DATA, batch_size=3, drop_last=True, collate_fn=lambda b: b, num_workers=0)
    rebuilt = distribute(original, 2, 1, 0)
    assert (rebuilt.batch_size, rebuilt.drop_last, rebuilt.collate_fn) == (3, True, original.collate_fn)


class FixedOrder(Sampler[int]):
    def __init__(self, order: list[int]) -> None:
        self.order = order
        self.epochs: list[int] = []

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_custom_sampler_is_sharded_in_its_own_order() -> None:
    order = [9, 3, 1, 7, 5, 0, 2]
    shards = [_indexes(distribute(DataLoader(DATA, sampler=FixedOrder(order)), 2, r, 0)) for r in range(2)]
    assert shards == [[9, 1, 5, 2], [3, 7, 0, 9]]
    sampler = distribute(DataLoader(DATA, sampler=FixedOrder(order)), 2, 0, 0).sampler
    assert isinstance(sampler, ShardedSampler)
    sampler.set_epoch(4)
    assert sampler.sampler.source.epochs == [4]


def test_a_distributed_sampler_is_left_alone() -> None:
    loader = DataLoader(DATA, sampler=DistributedSampler(DATA, num_replicas=2, rank=0))
    assert distribute(loader, 2, 0, 0) is loader  # streams: test_streams.py


@pytest.mark.parametrize("drop_last", [False, True])
def test_an_explicit_batch_sampler_keeps_its_batches_and_shuffle(drop_last: bool) -> None:
    # `DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 3, drop_last))`: each rank
    # gets batches of 3 from its shard of a shuffle, not single samples in order.
    def loader() -> DataLoader:
        return DataLoader(DATA * 2, batch_sampler=BatchSampler(RandomSampler(DATA * 2), 3, drop_last))

    shards = [distribute(loader(), 2, rank, seed=5) for rank in range(2)]
    batches = [[batch.tolist() for batch in shard] for shard in shards]
    sizes = [len(b) for rank in batches for b in rank]
    assert sizes == ([3] * 6 if drop_last else [3, 3, 3, 1] * 2)
    for rank, shard in enumerate(shards):
        inner = shard.batch_sampler.sampler
        assert isinstance(inner, DistributedSampler) and inner.shuffle and inner.rank == rank
    assert sorted(i for rank in batches for b in rank for i in b) == sorted(DATA * 2) or drop_last
    assert [i for b in batches[0] for i in b] != sorted(i for b in batches[0] for i in b)  # shuffled


def test_a_set_up_loader_with_a_batch_sampler_shuffles_differently_each_epoch() -> None:
    from lite_core.data._lite_loader import LiteDataLoader

    data = list(range(40))
    shard = distribute(DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, False)), 2, 0, 1)
    lite_loader = LiteDataLoader(shard, None)
    epochs = [[i for batch in lite_loader for i in batch.tolist()] for _ in range(2)]
    expected = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=1)
    for epoch, seen in enumerate(epochs):
        expected.set_epoch(epoch)
        assert seen == list(expected)
    assert epochs[0] != epochs[1]


def test_a_recorded_subclass_with_a_batch_sampler_is_rebuilt_with_batches() -> None:
    class Batched(DataLoader):
        def __init__(self, data: list[int], size: int) -> None:
            super().__init__(data, batch_sampler=BatchSampler(SequentialSampler(data), size, False))

    with recording_loader_arguments():
        loaders = [Batched(DATA, 2) for _ in range(2)]
    shards = [[batch.tolist() for batch in distribute(loader, 2, rank, 0)] for rank, loader in enumerate(loaders)]
    assert shards == [[[0, 2], [4, 6], [8]], [[1, 3], [5, 7], [9]]]


def test_recording_is_the_running_contexts_not_the_processes() -> None:
    # A process-wide switch recorded the loaders of every thread while any run() was executing
    # (and a run that ended in one thread switched it off for a run still going in another).
    import threading

    class Sized(DataLoader):
        def __init__(self, data: list[int], size: int) -> None:
            super().__init__(data, batch_size=size)

    elsewhere: list[DataLoader] = []
    with recording_loader_arguments():
        thread = threading.Thread(target=lambda: elsewhere.append(Sized(DATA, 2)))
        thread.start()
        thread.join()
        inside = Sized(DATA, 2)
    outside = Sized(DATA, 2)
    assert [_sharding._recorded.get(loader) for loader in (inside, elsewhere[0], outside)] == [((DATA, 2), {}), None, None]


def test_custom_batch_sampler_says_how_to_opt_out() -> None:
    class Batches(BatchSampler):
        pass

    loader = DataLoader(DATA, batch_sampler=Batches(range(10), 2, False))
    with pytest.raises(MisuseError, match="replace_sampler=False"):
        distribute(loader, 2, 0, 0)


def test_dataloader_subclass_that_cannot_be_rebuilt() -> None:
    class Special(DataLoader):
        def __init__(self, data: list[int]) -> None:
            super().__init__(data, batch_size=2)

    with pytest.raises(MisuseError, match="created outside run().*create it inside run().*replace_sampler=False"):
        distribute(Special(DATA), 2, 0, 0)


class MyLoader(DataLoader):
    """A user's loader whose __init__ takes its own arguments, not DataLoader's."""

    def __init__(self, dataset: list[int], my_arg: str, batch_size: int) -> None:
        self.my_arg = my_arg
        super().__init__(dataset, batch_size=batch_size, shuffle=True)


def test_dataloader_subclass_created_inside_run_is_rebuilt_with_a_distributed_sampler() -> None:
    with recording_loader_arguments():  # what run() does around the user's code
        loaders = [MyLoader(DATA, my_arg="mine", batch_size=3) for _ in range(2)]
    shards = [distribute(loader, 2, rank, 0) for rank, loader in enumerate(loaders)]
    for rank, shard in enumerate(shards):
        assert type(shard) is MyLoader and shard.my_arg == "mine" and shard.batch_size == 3
        assert isinstance(shard.sampler, DistributedSampler) and shard.sampler.rank == rank
        assert shard.sampler.shuffle  # the loader's own shuffle=True is kept
    seen = [[i for batch in shard for i in batch.tolist()] for shard in shards]
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == DATA
    with pytest.raises(MisuseError, match="created outside run()"):  # made after run() ended: not recorded
        distribute(MyLoader(DATA, my_arg="late", batch_size=3), 2, 0, 0)


class _Worker(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> float:
        return random.random()


@pytest.mark.timeout(60)
def test_seed_everything_seeds_dataloader_workers() -> None:
    def draws() -> list[float]:
        seed_everything(7, workers=True)
        lite = LightningLite(accelerator="cpu")
        loader = lite.setup_dataloaders(DataLoader(_Worker(), batch_size=1, num_workers=2))
        return [float(x) for batch in loader for x in batch]

    first, second = draws(), draws()
    assert first == second
    assert len(set(first)) == len(first)  # workers do not repeat each other's stream


def test_seed_everything_returns_seed_and_repeats_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LITE_GLOBAL_SEED", raising=False)
    assert seed_everything(5) == 5
    a = (random.random(), torch.rand(1).item())
    seed_everything(5)
    assert a == (random.random(), torch.rand(1).item())
    monkeypatch.delenv("LITE_GLOBAL_SEED", raising=False)
    with pytest.warns(UserWarning, match="random seed"):
        seed_everything()
    with pytest.raises(ValueError, match="out of range"):
        seed_everything(-1)
