"""Streams (`IterableDataset`) under data parallelism, in one process: each rank's loader as Lite
builds it (`distribute`, `split_batches`), the refusals, and the position of a set-up stream
through a checkpoint. The same under `ddp` on 2 processes: tests/integration/test_streams.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lite_core import LightningLite
from lite_core.data._sharding import distribute, recording_loader_arguments, split_batches
from lite_core.data._streams import GlobalStream
from lite_core.errors import MisuseError


class Numbers(IterableDataset):
    """The stream 0, 1, ..., n-1, as a user writes one (it knows nothing of ranks or workers)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class Counted(Numbers):
    """A stream that knows its length (`len(loader)` then works, as in plain torch)."""

    def __len__(self) -> int:
        return self.n


class Shuffled(IterableDataset):
    """A stream through a shuffle buffer seeded by the epoch (`set_epoch`), as streaming libraries do."""

    def __init__(self, n: int, buffer: int = 5) -> None:
        self.n, self.buffer, self.epoch = n, buffer, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        rng, pending = random.Random(self.epoch), []
        for sample in range(self.n):
            pending.append(sample)
            if len(pending) == self.buffer:
                yield pending.pop(rng.randrange(len(pending)))
        rng.shuffle(pending)
        yield from pending


class Packed(IterableDataset):
    """Token documents of 1 to 5 tokens packed into blocks of `length` tokens: the tokens of the
    block under way carry over from one document to the next (a user's packing loader)."""

    def __init__(self, documents: int, length: int = 4) -> None:
        self.documents, self.length = documents, length

    def __iter__(self) -> Iterator[torch.Tensor]:
        token, block = 0, []
        for document in range(self.documents):
            for _ in range(1 + document % 5):
                block.append(token)
                token += 1
                if len(block) == self.length:
                    yield torch.tensor(block)
                    block = []


def batches(loader: Any) -> list[list[int]]:
    return [batch.flatten().tolist() if isinstance(batch, torch.Tensor) else [batch] for batch in loader]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_takes_every_world_size_th_batch_of_the_one_stream(world: int, workers: int) -> None:
    plain = batches(DataLoader(Numbers(24), batch_size=2))
    ranks = [batches(distribute(DataLoader(Numbers(24), batch_size=2, num_workers=workers), world, rank, 0))
             for rank in range(world)]
    assert ranks == [plain[rank::world] for rank in range(world)]  # every sample once, no worker repeats


def test_one_process_with_workers_yields_the_batches_of_no_workers() -> None:
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(Numbers(20), batch_size=3, num_workers=2))
    assert batches(loader) == batches(DataLoader(Numbers(20), batch_size=3))  # plain torch would repeat it


@pytest.mark.parametrize("drop_last", [False, True])
def test_split_batches_cuts_each_global_batch_of_the_stream_into_contiguous_parts(drop_last: bool) -> None:
    plain = batches(DataLoader(Numbers(23), batch_size=4, drop_last=drop_last))
    parts = [batches(split_batches(DataLoader(Numbers(23), batch_size=4, drop_last=drop_last, num_workers=2),
                                   lambda rank=rank: (rank, 2), 2)) for rank in range(2)]
    assert [a + b for a, b in zip(*parts)] == plain
    assert parts[0][-1] == ([16, 17] if drop_last else [20, 21])  # [20, 21, 22] cut into parts of 2 and 1
    assert parts[1][-1] == ([18, 19] if drop_last else [22])


def test_the_short_last_round_of_per_rank_batches_repeats_samples_only_where_too_short() -> None:
    ranks = [batches(distribute(DataLoader(Numbers(9), batch_size=2), 2, rank, 0)) for rank in range(2)]
    assert ranks == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [8]]]  # 1 sample for 2 ranks: DistributedSampler's padding
    ranks = [batches(distribute(DataLoader(Numbers(11), batch_size=2), 2, rank, 0)) for rank in range(2)]
    assert ranks == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10]]]
    ranks = [batches(distribute(DataLoader(Numbers(11), batch_size=2, drop_last=True), 2, r, 0)) for r in range(2)]
    assert ranks == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


@pytest.mark.parametrize(("n", "drop_last"), [(24, False), (23, False), (9, False), (23, True)])
@pytest.mark.parametrize("split", [False, True])
def test_the_length_of_a_stream_with_one_is_each_rank_s_number_of_batches(n: int, drop_last: bool, split: bool) -> None:
    if split and n == 9 and not drop_last:
        return  # refused when it comes
    for rank in range(2):
        loader = (split_batches(DataLoader(Counted(n), batch_size=4, drop_last=drop_last), lambda: (rank, 2), 2)
                  if split else distribute(DataLoader(Counted(n), batch_size=2, drop_last=drop_last), 2, rank, 0))
        assert len(loader) == len(batches(loader)), rank
    with pytest.raises(TypeError):
        len(distribute(DataLoader(Numbers(8), batch_size=2), 2, 0, 0))


def test_split_batches_refuses_a_last_batch_smaller_than_the_processes_when_it_comes() -> None:
    loader = split_batches(DataLoader(Numbers(9), batch_size=4), lambda: (0, 2), 2)
    with pytest.raises(MisuseError, match="last batch holds 1 samples, fewer than the 2 .* drop_last=True"):
        batches(loader)


@pytest.mark.parametrize(("loader", "match"), [
    (lambda: DataLoader(Numbers(8), batch_size=None), "batch_size=None: give it the global batch size"),
    (lambda: DataLoader(Numbers(8), batch_size=3), "batch of 3 samples over 2 data-parallel processes"),
    (lambda: DataLoader(Numbers(8), batch_size=4, num_workers=2, in_order=False), "leave in_order=True"),
])
def test_streams_lite_cannot_cut_are_refused_at_set_up(loader: Any, match: str) -> None:
    with pytest.raises(MisuseError, match=match):
        split_batches(loader(), lambda: (0, 2), 2)


class SelfSharded(Numbers):
    """A dataset that splits itself over ranks and workers: it declares so with `lite_shard`."""

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(n)
        self.num_replicas, self.rank = num_replicas, rank

    def lite_shard(self, num_replicas: int, rank: int) -> SelfSharded:
        return SelfSharded(self.n, num_replicas, rank)

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(self.rank * workers + worker, self.n, self.num_replicas * workers))


def test_a_dataset_that_shards_itself_is_asked_for_its_rank_s_shard() -> None:
    ranks = [distribute(DataLoader(SelfSharded(12), batch_size=2, num_workers=2), 3, rank, 0) for rank in range(3)]
    assert [(loader.dataset.num_replicas, loader.dataset.rank) for loader in ranks] == [(3, 0), (3, 1), (3, 2)]
    assert sorted(i for loader in ranks for batch in batches(loader) for i in batch) == list(range(12))
    with pytest.raises(MisuseError, match="shards itself over the ranks: leave split_batches out"):
        split_batches(DataLoader(SelfSharded(12), batch_size=4), lambda: (0, 2), 2)


def test_the_set_up_stream_forwards_attributes_and_set_epoch_to_the_user_s_dataset() -> None:
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(Shuffled(20), batch_size=4))
    assert isinstance(loader.dataset, GlobalStream) and loader.dataset.buffer == 5
    epochs = [batches(loader) for _ in range(2)]
    expected = []
    for epoch in range(2):
        dataset = Shuffled(20)
        dataset.set_epoch(epoch)
        expected.append(batches(DataLoader(dataset, batch_size=4)))
    assert epochs == expected and epochs[0] != epochs[1]


def _interrupted(make: Any, after: int, path: Path, workers: int = 0, cls: type = DataLoader,
                 **loader_kwargs: Any) -> list[list[int]]:
    """The batches of one epoch of a set-up stream, checkpointed after `after` batches and resumed in a
    fresh loader (with `workers`); what the two loaders handed out, in order."""
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(cls(make(), **loader_kwargs))
    seen = []
    for batch in loader:
        seen.append(batch.flatten().tolist())
        if len(seen) == after:
            lite.save({"loader": loader}, path)
            break
    resumed = lite.setup_dataloaders(cls(make(), num_workers=workers, **loader_kwargs))
    lite.load(path, {"loader": resumed})
    return seen + batches(resumed)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumed_mid_epoch_goes_on_with_the_next_batch(tmp_path: Path, workers: int) -> None:
    for epoch_before in range(2):  # in the first epoch, and in the second (the shuffle buffer's seed)
        lite = LightningLite(accelerator="cpu")
        loader = lite.setup_dataloaders(DataLoader(Shuffled(30), batch_size=4))
        uninterrupted = [batches(loader) for _ in range(2)][epoch_before]
        loader = lite.setup_dataloaders(DataLoader(Shuffled(30), batch_size=4))
        for _ in range(epoch_before):
            batches(loader)
        seen = []
        for batch in loader:
            seen.append(batch.tolist())
            if len(seen) == 3:
                lite.save({"loader": loader}, tmp_path / "ckpt.pt")
                break
        state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
        assert (state["epoch"], state["consumed"]) == (epoch_before, 12)
        resumed = lite.setup_dataloaders(DataLoader(Shuffled(30), batch_size=4, num_workers=workers))
        lite.load(tmp_path / "ckpt.pt", {"loader": resumed})
        assert seen + batches(resumed) == uninterrupted
        assert resumed.state_dict()["epoch"] == epoch_before + 1  # the interrupted epoch counted once
        assert not any(batches(resumed)[0] == b for b in seen)  # the next epoch starts at the stream's start


def test_the_partial_block_of_a_packed_stream_is_part_of_the_position(tmp_path: Path) -> None:
    plain = batches(DataLoader(Packed(20), batch_size=2))
    assert _interrupted(lambda: Packed(20), 3, tmp_path / "ckpt.pt", workers=2, batch_size=2) == plain


def test_persistent_workers_take_up_a_position_loaded_after_they_started(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(Numbers(12), batch_size=2, num_workers=2, persistent_workers=True))
    iterator = iter(loader)
    seen = [next(iterator).tolist() for _ in range(2)]
    lite.save({"loader": loader}, tmp_path / "ckpt.pt")
    del iterator
    assert batches(loader)[0] == [0, 1]  # a new pass, workers kept
    lite.load(tmp_path / "ckpt.pt", {"loader": loader})
    assert seen + batches(loader) == batches(DataLoader(Numbers(12), batch_size=2))
    assert batches(loader)[0] == [0, 1]  # and the pass after starts the stream again


def test_a_stateful_dataloader_over_a_stream_keeps_the_global_position(tmp_path: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(stateful.StatefulDataLoader(Shuffled(30), batch_size=4, num_workers=2))
    assert type(loader.dataloader) is stateful.StatefulDataLoader and isinstance(loader.dataset, GlobalStream)
    plain = batches(DataLoader(Shuffled(30), batch_size=4))
    assert batches(loader) == plain  # not once per worker
    interrupted = _interrupted(lambda: Shuffled(30), 2, tmp_path / "ckpt.pt", workers=2,
                               cls=stateful.StatefulDataLoader, batch_size=4)
    assert interrupted == plain
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    assert state == {"epoch": 0, "consumed": 8, "stream": True, "processes": 1}  # no per-rank iterator state


# -- Hugging Face `datasets` (in the `test` environment) -------------------------------------------


def _hugging_face_stream(shards: int) -> Any:
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict({"id": list(range(24))}).to_iterable_dataset(num_shards=shards)


@pytest.mark.parametrize(("shards", "workers"), [(4, 2), (3, 0), (3, 2)])  # 3: the ranks do not divide the shards
def test_a_hugging_face_stream_is_split_by_node_each_sample_once(shards: int, workers: int) -> None:
    ranks = [distribute(DataLoader(_hugging_face_stream(shards), batch_size=4, num_workers=workers), 2, rank, 0)
             for rank in range(2)]
    ids = [i for loader in ranks for batch in loader for i in batch["id"].tolist()]
    assert sorted(ids) == list(range(24))
    with pytest.raises(MisuseError, match="IterableDataset shards itself over the ranks"):
        split_batches(DataLoader(_hugging_face_stream(shards), batch_size=4), lambda: (0, 2), 2)


def test_lite_tells_the_epoch_to_the_shuffle_buffer_of_a_hugging_face_stream() -> None:
    lite = LightningLite(accelerator="cpu")
    stream = _hugging_face_stream(3).shuffle(seed=1, buffer_size=6)
    loader = lite.setup_dataloaders(DataLoader(stream, batch_size=24))
    epochs = [next(iter(loader))["id"].tolist() for _ in range(2)]
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1]) == list(range(24))
    assert loader.dataset.epoch == 1  # the split copy Lite reads, which the user cannot reach


class _PretendDataParallelRankOneOfTwo(LightningLite):
    """One process set up as data-parallel rank 1 of 2 (as every tensor-parallel peer of that rank
    is under `model_parallel`: the strategy's sampler arguments are the data-parallel ones)."""

    def __init__(self) -> None:
        super().__init__(accelerator="cpu", strategy="single_device")
        self.strategy.distributed_sampler_kwargs = lambda: {"num_replicas": 2, "rank": 1}  # type: ignore[method-assign]


@pytest.mark.parametrize("split", [False, True])
def test_set_up_streams_take_the_data_parallel_rank_s_part_and_count_global_samples(split: bool,
                                                                                   tmp_path: Path) -> None:
    lite = _PretendDataParallelRankOneOfTwo()
    loader = lite.setup_dataloaders(DataLoader(Numbers(16), batch_size=4 if split else 2), split_batches=split)
    assert batches(loader) == [[2, 3], [6, 7], [10, 11], [14, 15]]
    for seen, _ in enumerate(loader, start=1):
        if seen == 3:
            break
    assert loader.state_dict() == {"epoch": 1, "consumed": 12, "stream": True, "processes": 2}


class Pairs(IterableDataset):
    """`(tensor of 3, id)` samples 0..n-1 (a structure to empty)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        return ((torch.full((3,), float(i)), i) for i in range(self.n))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_evaluation_pass_over_a_stream_reads_each_sample_once_with_as_many_batches_per_rank(workers: int) -> None:
    ranks = []
    for rank in range(2):
        lite = _PretendDataParallelRankOneOfTwo()
        lite.strategy.distributed_sampler_kwargs = lambda rank=rank: {"num_replicas": 2, "rank": rank}
        model = lite.setup(torch.nn.Linear(1, 1))
        loader = lite.setup_dataloaders(DataLoader(Pairs(9), batch_size=2, num_workers=workers))
        training = [ids.tolist() for _, ids in loader]
        model.eval()
        evaluation = [(x.shape, ids.tolist()) for x, ids in loader]
        assert len(loader) == len(evaluation) == 3
        ranks.append((training, evaluation))
    assert [training for training, _ in ranks] == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [8]]]  # padded
    assert [evaluation for _, evaluation in ranks] == [
        [((2, 3), [0, 1]), ((2, 3), [4, 5]), ((1, 3), [8])],
        [((2, 3), [2, 3]), ((2, 3), [6, 7]), ((0, 3), [])],  # no sample left: an empty batch, as many batches
    ]


def test_sharding_evaluation_cuts_a_stream_for_every_pass() -> None:
    lite = _PretendDataParallelRankOneOfTwo()
    loader = lite.setup_dataloaders(DataLoader(Numbers(11), batch_size=2), sharding="evaluation")
    assert batches(loader) == [[2, 3], [6, 7], [10]] == batches(loader)


class Seekable(Numbers):
    """A stream that can start at any sample (`lite_iter_from`), counting the samples it produces."""

    produced = 0

    def __iter__(self) -> Iterator[int]:
        return self.lite_iter_from(0)

    def lite_iter_from(self, start: int) -> Iterator[int]:
        for sample in range(start, self.n):
            Seekable.produced += 1
            yield sample


class OwnIterator(Numbers):
    """A stream that is its own iterator: `__iter__` starts it again and returns `self` (litdata's
    `StreamingDataset` is written so)."""

    def __iter__(self) -> OwnIterator:
        self.next = 0
        return self

    def __next__(self) -> int:
        if self.next >= self.n:
            raise StopIteration
        self.next += 1
        return self.next - 1


# A pass takes milliseconds; 60 s is a hang guard (a stream started again at every round never ends).
@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_is_its_own_iterator_is_read_once_per_pass(workers: int) -> None:
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(OwnIterator(20), batch_size=3, num_workers=workers))
    assert batches(loader) == batches(DataLoader(Numbers(20), batch_size=3))
    assert batches(loader) == batches(DataLoader(Numbers(20), batch_size=3))  # the next epoch, again from the start


def test_a_stream_that_can_seek_resumes_without_reading_the_consumed_samples(tmp_path: Path) -> None:
    interrupted = _interrupted(lambda: Seekable(1000), 3, tmp_path / "ckpt.pt", batch_size=10)
    assert interrupted == batches(DataLoader(Numbers(1000), batch_size=10))
    Seekable.produced = 0
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(Seekable(1000), batch_size=10))
    lite.load(tmp_path / "ckpt.pt", {"loader": loader})
    assert batches(loader)[0] == list(range(30, 40)) and Seekable.produced == 1000 - 30


def test_a_dataloader_subclass_of_a_stream_made_in_run_is_rebuilt_around_the_cut() -> None:
    class Tokens(DataLoader):  # its own __init__, as a library's loader has
        def __init__(self, stream: IterableDataset, size: int) -> None:
            super().__init__(stream, batch_size=size, collate_fn=lambda samples: torch.tensor(samples) * 10)

    with recording_loader_arguments():
        loaders = [Tokens(Numbers(8), 2) for _ in range(2)]
    shards = [distribute(loader, 2, rank, 0) for rank, loader in enumerate(loaders)]
    assert all(type(shard) is Tokens and isinstance(shard.dataset, GlobalStream) for shard in shards)
    assert [batches(shard) for shard in shards] == [[[0, 10], [40, 50]], [[20, 30], [60, 70]]]
