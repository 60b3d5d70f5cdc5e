"""Streams (`IterableDataset`s) shared by the data-parallel processes: each sample to one of them,
and one position in the stream for the whole job.

Lite picks one of two mechanisms from what the dataset offers:

- **The dataset shards itself.** A dataset with a method `lite_shard(num_replicas, rank)`
  (`ShardsItself`) is asked for the dataset that yields only data-parallel rank `rank`'s samples
  of `num_replicas`; it must also split them over the loader's workers itself
  (`torch.utils.data.get_worker_info()`). Lite then only rebuilds the loader around what it
  returns; the loader resumes at its epoch (or from its own state). Hugging Face
  `datasets.IterableDataset` (`split_dataset_by_node`) and litdata's `StreamingDataset` (told the
  data-parallel rank and size) are taken this way without a `lite_shard`.
- **One global stream, cut per round** (`GlobalStream`, every other `IterableDataset`). Every
  process reads the whole stream and cuts it into rounds of one global batch: `batch_size *
  world_size` samples for per-rank batches, `batch_size` with `split_batches=True`. Rank `r` of `W`
  takes the `r`-th contiguous `1/W` of each round, which is the `r`-th per-rank batch, or its
  contiguous part of the global batch as `split_batches` cuts indexed batches. A short last round
  is left out with `drop_last=True`; otherwise it is cut into parts that differ by at most one
  sample (`rank_slice`), and where it holds fewer samples than processes, per-rank batches repeat
  its first samples (as `DistributedSampler` pads) while `split_batches` refuses it; an
  evaluation cut repeats nothing and gives a rank left without a sample an empty batch. With `K`
  workers, worker `w` yields the rounds `w, w + K, ...` of the whole stream, which the loader
  hands out in turn: the batches are those of `num_workers=0`. The job's position is the number of
  samples of the stream that the consumed rounds held, the same on every rank; `skip` makes the
  next pass start that many samples in before cutting rounds again: through the source's
  `lite_iter_from(start)` where it has one (a source that can seek), else by reading and dropping
  them.
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import IterableDataset, get_worker_info

from lite_core.data._order import ForwardsEpoch, rank_slice
from lite_core.errors import MisuseError


@runtime_checkable
class ShardsItself(Protocol):
    """An `IterableDataset` that gives each data-parallel rank its own samples itself.

    `lite_shard(num_replicas, rank)` returns the dataset that yields only rank `rank`'s samples
    (it may return `self` after recording them); the returned dataset also splits them over the
    loader's worker processes (`torch.utils.data.get_worker_info()`), so that each sample is read
    by one worker of one rank per epoch.
    """

    def lite_shard(self, num_replicas: int, rank: int) -> IterableDataset: ...


def shards_itself(dataset: Any) -> bool:
    """Whether `dataset` splits its samples over the ranks itself (`ShardsItself`, a Hugging Face
    `datasets.IterableDataset`, split with `split_dataset_by_node`, or a litdata `StreamingDataset`)."""
    return isinstance(dataset, ShardsItself) or _is_hugging_face_stream(dataset) or _is_litdata_stream(dataset)


def _is_litdata_stream(dataset: Any) -> bool:
    litdata = sys.modules.get("litdata")  # never imported here: a dataset of it means it is loaded
    return litdata is not None and isinstance(dataset, getattr(litdata, "StreamingDataset", ()))


def _is_hugging_face_stream(dataset: Any) -> bool:
    datasets = sys.modules.get("datasets")  # never imported here: a dataset of it means it is loaded
    return datasets is not None and isinstance(dataset, getattr(datasets, "IterableDataset", ()))


def own_shard(dataset: Any, num_replicas: int, rank: int) -> Any:
    """The dataset that yields rank `rank`'s samples of a dataset that `shards_itself`."""
    if _is_hugging_face_stream(dataset) and not isinstance(dataset, ShardsItself):
        from datasets.distributed import split_dataset_by_node  # type: ignore[import-not-found]

        return split_dataset_by_node(dataset, rank=rank, world_size=num_replicas)
    if _is_litdata_stream(dataset) and not isinstance(dataset, ShardsItself):
        return _litdata_shard(dataset, num_replicas, rank)
    return dataset.lite_shard(num_replicas, rank)


def _litdata_shard(dataset: Any, num_replicas: int, rank: int) -> Any:
    """A litdata `StreamingDataset` splits its chunks over the ranks of its `distributed_env`, which
    it reads from torch.distributed when it is made (every process of the job, or none before the
    process group exists): it is given the data-parallel ones instead, in place."""
    env = copy.copy(dataset.distributed_env)
    nodes = env.num_nodes if env.num_nodes >= 1 and num_replicas % env.num_nodes == 0 else 1
    env.world_size, env.global_rank, env.num_nodes = num_replicas, rank, nodes
    dataset.distributed_env = env
    return dataset


@dataclass(eq=False)  # compared and hashed as itself, as a dataset is
class GlobalStream(ForwardsEpoch, IterableDataset):
    """Rank `dp_rank`'s part of each round of `source`, read whole on every process (see the module).

    Args:
        source: the user's `IterableDataset`.
        part: the samples a rank takes of each full round (the rank's batch size).
        dp_rank: this process's data-parallel rank.
        dp_size: the data-parallel size; a round holds `part * dp_size` samples.
        drop_last: leave out the short last round.
        split: the round is one plain process's global batch (`split_batches=True`): a short last
            round with fewer samples than processes is refused rather than padded.
        evaluation: an evaluation pass's cut: a short last round is never padded; a rank without
            samples in it gets an `EmptyPart` (which the loader's collate turns into an empty
            batch), so that every rank has as many batches and each sample is read once.
    """

    source: IterableDataset
    part: int
    dp_rank: int
    dp_size: int
    drop_last: bool
    split: bool
    evaluation: bool = False
    #: Samples of the stream consumed before the next pass (set by the loader's position).
    skip: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._mine = slice(self.dp_rank * self.part, (self.dp_rank + 1) * self.part)  # this rank's part of a full round

    @property
    def round_size(self) -> int:
        """How many samples of the stream one global batch holds."""
        return self.part * self.dp_size

    def __iter__(self) -> Iterator[Any]:
        # Read once per pass: a worker's copy (persistent workers keep theirs) must not skip again.
        skip, self.skip = self.skip, 0
        stream = _from(self.source, skip)
        info = get_worker_info()
        workers = 1 if info is None else info.num_workers
        if self.dp_size == 1 and workers == 1:
            return stream  # one rank's round is its batch, which the loader makes: nothing to cut
        rounds: Iterator[list[Any]] = self._rounds(stream)
        if info is not None and workers > 1:
            rounds = itertools.islice(rounds, info.id, None, workers)  # this worker's rounds
        # Python runs once per round, never per sample: the samples come out of C iterators.
        return itertools.chain.from_iterable(map(self._part_of, rounds))

    def _rounds(self, stream: Iterator[Any]) -> Iterator[list[Any]]:
        size, islice = self.round_size, itertools.islice
        while True:
            round_ = list(islice(stream, size))
            if len(round_) == size:
                yield round_
                continue
            if round_ and not self.drop_last:
                yield round_
            return

    def _part_of(self, round_: list[Any]) -> list[Any]:
        if len(round_) == self.part * self.dp_size:
            return round_[self._mine]
        if len(round_) < self.dp_size and self.evaluation:
            mine = rank_slice(round_, self.dp_rank, self.dp_size)
            return mine or [EmptyPart(round_[0])]
        if len(round_) < self.dp_size:
            if self.split:
                raise MisuseError(
                    f"With split_batches=True the stream's last batch holds {len(round_)} samples, fewer than the"
                    f" {self.dp_size} data-parallel processes it is split over: pass drop_last=True to the DataLoader."
                )
            round_ = list(itertools.islice(itertools.cycle(round_), self.dp_size))  # as DistributedSampler pads
        return rank_slice(round_, self.dp_rank, self.dp_size)

    def __len__(self) -> int:
        """How many samples this process takes in the next pass, where the source has a length (a
        `TypeError` as from `len()` where it has none)."""
        total = max(len(self.source) - self.skip, 0)  # type: ignore[arg-type]
        full, rest = divmod(total, self.round_size)
        if rest and not self.drop_last:  # the last round's part: at least 1 sample (padded, or an EmptyPart)
            rest = len(rank_slice(list(range(max(rest, self.dp_size))), self.dp_rank, self.dp_size))
        else:
            rest = 0
        return full * self.part + rest

    def __getattr__(self, name: str) -> Any:
        if name == "source":  # not yet set (unpickling in a worker)
            raise AttributeError(name)
        return getattr(self.source, name)

    def __repr__(self) -> str:
        return f"GlobalStream({self.source!r}, rank {self.dp_rank} of {self.dp_size})"


def _from(source: Any, start: int) -> Iterator[Any]:
    """`source`'s samples from its `start`-th on: it seeks there itself with `lite_iter_from(start)`
    (an iterable of the samples from `start` on), or its first `start` samples are read and dropped.

    The result is always a fresh iterator that `iter()` leaves as it is: a dataset that is its own
    iterator (`__iter__` returns `self` and starts the stream again, as litdata's
    `StreamingDataset` does) would otherwise be started again by every round's `islice`."""
    seek = getattr(source, "lite_iter_from", None)
    if start and callable(seek):
        return itertools.islice(iter(seek(start)), None)
    return itertools.islice(iter(source), start, None)


class EmptyPart:
    """What an evaluation cut yields for a rank that has no sample in the stream's last round: one
    of the round's samples, which the loader's collate turns into an empty batch of its structure."""

    __slots__ = ("sample",)

    def __init__(self, sample: Any) -> None:
        self.sample = sample

    def __getstate__(self) -> tuple[Any]:
        return (self.sample,)  # never empty: pickle calls __setstate__ only for a true state

    def __setstate__(self, state: tuple[Any]) -> None:
        self.sample = state[0]


def check_stream_loader(dataloader: Any, split: bool, dp_size: int) -> None:
    """Refuse, at set-up, a stream's loader that Lite cannot cut into one global stream."""
    if split and dataloader.batch_size is None:
        raise MisuseError(
            "setup_dataloaders(split_batches=True) splits each batch over the processes, but this loader has"
            " batch_size=None: give it the global batch size."
        )
    if split and dataloader.batch_size % dp_size:
        raise MisuseError(
            f"setup_dataloaders(split_batches=True) splits each batch of {dataloader.batch_size} samples over"
            f" {dp_size} data-parallel processes, which does not divide it: make the batch size a multiple of"
            f" {dp_size}."
        )
    if dataloader.num_workers > 0 and not getattr(dataloader, "in_order", True):
        raise MisuseError(
            "A stream's batches from DataLoader(in_order=False) come in whatever order its workers finish, so"
            " Lite cannot keep the job's position in the stream: leave in_order=True."
        )
