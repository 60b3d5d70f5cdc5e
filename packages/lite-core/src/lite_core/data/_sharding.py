"""Gives each process its own shard of a dataloader's samples."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import weakref
from collections.abc import Iterator, Mapping, Sized
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable

import torch

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lite_core.move import rebuild_mapping
from lite_core.data._order import BatchPart, EpochOrder, ResumableDistributedSampler, ShardedSampler, SplitBatches
from lite_core.data._streams import EmptyPart, GlobalStream, check_stream_loader, own_shard, shards_itself
from lite_core.seed import seed_worker, worker_seeding_enabled
from lite_core.errors import MisuseError

# DataLoader arguments that describe how it loads (everything but what picks the samples).
_LOADER_ARGUMENTS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)


#: torchdata's `StatefulDataLoader` batches with its own `BatchSampler`, which batches as torch's does.
_PLAIN_BATCH_SAMPLER_MODULES = ("torch.utils.data.sampler", "torchdata.stateful_dataloader.sampler")


def _is_plain_batch_sampler(batch_sampler: Any) -> bool:
    cls = type(batch_sampler)
    return cls.__name__ == "BatchSampler" and cls.__module__ in _PLAIN_BATCH_SAMPLER_MODULES


def _plain_batch_sampler(dataloader: DataLoader) -> BatchSampler | None:
    """The dataloader's batch sampler (None with `batch_size=None`); a custom one Lite cannot shard is refused."""
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and not _is_plain_batch_sampler(batch_sampler):
        raise MisuseError(
            f"The dataloader uses a custom batch sampler ({type(batch_sampler).__name__}) that Lite cannot"
            " shard: make it yield this rank's batches and pass setup_dataloaders(..., replace_sampler=False)."
        )
    return batch_sampler


def distribute(dataloader: DataLoader, num_replicas: int, rank: int, seed: int) -> DataLoader:
    """A copy of `dataloader` that loads only this rank's shard, with its other settings kept."""
    if isinstance(dataloader.dataset, IterableDataset):
        return stream_shard(dataloader, rank, num_replicas, split=False)
    batch_sampler = _plain_batch_sampler(dataloader)
    if batch_sampler is not None and dataloader.batch_size is None:  # `batch_sampler=BatchSampler(...)`
        sampler = _sharded(dataloader, batch_sampler.sampler, batch_sampler.drop_last, num_replicas, rank, seed)
        if sampler is None:
            return dataloader
        return _rebuild(dataloader, {"batch_sampler": BatchSampler(sampler, batch_sampler.batch_size,
                                                                   batch_sampler.drop_last)})
    sampler = _sharded(dataloader, dataloader.sampler, dataloader.drop_last, num_replicas, rank, seed)
    if sampler is None:
        return dataloader
    return _rebuild(dataloader, {"sampler": sampler, "batch_size": dataloader.batch_size,
                                 "drop_last": dataloader.drop_last})


def _sharded(dataloader: DataLoader, sampler: Any, drop_last: bool, num_replicas: int, rank: int,
             seed: int) -> Sampler[Any] | None:
    """This rank's shard of `sampler`, the sampler behind `dataloader`'s batches (`None`: already sharded)."""
    if isinstance(sampler, DistributedSampler):
        return None
    if type(sampler) in (RandomSampler, SequentialSampler) and not getattr(sampler, "replacement", False):
        shuffle = isinstance(sampler, RandomSampler)
        return ResumableDistributedSampler(dataloader.dataset, num_replicas=num_replicas, rank=rank,
                                           shuffle=shuffle, seed=seed, drop_last=drop_last)
    if not isinstance(sampler, Sized):
        raise MisuseError(
            f"The dataloader's sampler ({type(sampler).__name__}) has no length, so Lite cannot shard it:"
            " pass setup_dataloaders(..., replace_sampler=False) and shard it yourself."
        )
    return ShardedSampler(EpochOrder(sampler), num_replicas, rank, drop_last=drop_last)


def in_order(dataloader: DataLoader) -> DataLoader:
    """A copy of `dataloader` (one process) whose sampler can resume its epoch at any sample
    (`EpochOrder`); the loader itself where Lite cannot rebuild it (then it resumes at epochs only)."""
    if not isinstance(dataloader.sampler, Sized) and not isinstance(dataloader.dataset, IterableDataset):
        return dataloader
    try:
        if isinstance(dataloader.dataset, IterableDataset):  # with its position, and not repeated by workers
            return stream_shard(dataloader, 0, 1, split=False)
        batch_sampler = _plain_batch_sampler(dataloader)
        if batch_sampler is not None and dataloader.batch_size is None:  # `batch_sampler=BatchSampler(...)`
            return _rebuild(dataloader, {"batch_sampler": BatchSampler(EpochOrder(batch_sampler.sampler),
                                                                       batch_sampler.batch_size,
                                                                       batch_sampler.drop_last)})
        return _rebuild(dataloader, {"sampler": EpochOrder(dataloader.sampler), "batch_size": dataloader.batch_size,
                                     "drop_last": dataloader.drop_last})
    except MisuseError:  # a custom batch sampler, or a subclass made outside run()
        return dataloader


def split_batches(dataloader: DataLoader, part: BatchPart, dp_size: int) -> DataLoader:
    """A copy of `dataloader` whose every batch is this process's part (`part()`) of the batch one
    plain process draws (`setup_dataloaders(..., split_batches=True)`)."""
    if isinstance(dataloader.dataset, IterableDataset):
        return stream_shard(dataloader, part()[0], dp_size, split=True)
    batch_sampler = _plain_batch_sampler(dataloader)
    if batch_sampler is None:
        raise MisuseError(
            "setup_dataloaders(split_batches=True) splits each batch over the processes, but this loader has"
            " batch_size=None: give it the global batch size."
        )
    size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
    if size % dp_size:
        raise MisuseError(
            f"setup_dataloaders(split_batches=True) splits each batch of {size} samples over {dp_size}"
            f" data-parallel processes, which does not divide it: make the batch size a multiple of {dp_size}."
        )
    last = len(batch_sampler.sampler) % size  # type: ignore[arg-type]
    if last and not drop_last and last < dp_size:
        raise MisuseError(
            f"With split_batches=True the epoch's last batch holds {last} samples, fewer than the {dp_size}"
            " data-parallel processes it is split over: pass drop_last=True to the DataLoader."
        )
    global_batches = BatchSampler(EpochOrder(batch_sampler.sampler), size, drop_last)
    return _rebuild(dataloader, {"batch_sampler": SplitBatches(global_batches, part)})


def stream_shard(dataloader: DataLoader, dp_rank: int, dp_size: int, split: bool,
                 evaluation: bool = False) -> DataLoader:
    """A copy of `dataloader` over an `IterableDataset` that yields only process `dp_rank`'s samples
    of the stream, each sample read by one worker (`lite_core.data._streams`): from the dataset
    itself where it shards itself, else by cutting one global stream per round. `split`: the
    loader's batch is the global batch (`split_batches=True`); `evaluation`: an evaluation pass's
    cut (no sample repeated; a rank without samples in the last round gets an empty batch)."""
    dataset = dataloader.dataset
    if shards_itself(dataset):
        if split:
            raise MisuseError(
                f"setup_dataloaders(split_batches=True) cuts the global batches of one stream, but this"
                f" {type(dataset).__name__} shards itself over the ranks: leave split_batches out and give the"
                " loader the per-rank batch size."
            )
        shard = own_shard(dataset, dp_size, dp_rank)
        if shard is dataset:
            return dataloader
        return _rebuild(dataloader, {"dataset": shard, "batch_size": dataloader.batch_size,
                                     "drop_last": dataloader.drop_last})
    check_stream_loader(dataloader, split, dp_size)
    size = dataloader.batch_size
    part = 1 if size is None else size // dp_size if split else size
    stream = GlobalStream(dataset, part, dp_rank, dp_size, dataloader.drop_last, split, evaluation)
    picking = {"dataset": stream, "batch_size": None if size is None else part, "drop_last": dataloader.drop_last}
    if evaluation:
        picking["collate_fn"] = _EmptyingCollate(dataloader.collate_fn, size is not None)
    return _rebuild(dataloader, picking)


class _EmptyingCollate:
    """The loader's `collate_fn`, which turns an evaluation cut's `EmptyPart` into an empty batch
    of the structure of the round's sample it holds (`emptied`)."""

    def __init__(self, collate: Callable[[Any], Any], batched: bool) -> None:
        self.collate = collate
        self.batched = batched  # automatic batching: `collate` gets a list of samples

    def __call__(self, batch: Any) -> Any:
        if self.batched and len(batch) == 1 and type(batch[0]) is EmptyPart:
            return emptied(self.collate([batch[0].sample]))
        if type(batch) is EmptyPart:
            return emptied(self.collate(batch.sample))
        return self.collate(batch)


def is_evaluation_shard(dataloader: DataLoader) -> bool:
    """Whether `dataloader` is an evaluation shard (`distribute_for_evaluation`), not the loader itself."""
    dataset = dataloader.dataset
    return (isinstance(dataloader.sampler, EvaluationSampler)
            or isinstance(dataset, GlobalStream) and dataset.evaluation)


# -- evaluation passes ---------------------------------------------------------------------------
# Training shards pad (DistributedSampler repeats samples so that every rank has as many), which an
# evaluation must not: a repeated sample is counted twice. An evaluation shard holds each sample
# of the one-process loader exactly once, and every rank still gets the same number of batches,
# so that a collective called once per batch (all_reduce, gather_for_metrics, FSDP's parameter
# gathers) is called as often on every rank; a rank short of samples gets empty last batches.


class EvaluationSampler(Sampler[int]):
    """This rank's samples for an evaluation pass: each sample of `order` once, none repeated.

    `order` is cut into rounds of `num_replicas * batch_size` samples. In a full round, rank `r`
    takes the round's `r`-th batch; the last round's samples are split into `num_replicas`
    consecutive parts (the first ones larger by one). So rank `r`'s `i`-th batch, gathered in
    rank order, is round `i` in the one-process order. `batches_per_rank` is the same on every
    rank: the rounds; where a round has fewer samples than ranks, some ranks have one batch fewer
    (`len(loader)`), and the set-up loader adds an empty batch for them.

    Args:
        order: the one-process order of the samples (the same on every rank).
        batch_size: the loader's batch size.
        drop_last: leave out the samples of the one-process loader's incomplete last batch.
        num_replicas: how many ranks hold distinct data.
        rank: this rank among them.
    """

    def __init__(self, order: Sampler[int], batch_size: int, drop_last: bool, num_replicas: int, rank: int) -> None:
        self.order = order
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank

    def _total(self) -> int:
        total = len(self.order)  # type: ignore[arg-type]
        return total - total % self.batch_size if self.drop_last else total

    def _spans(self) -> list[tuple[int, int]]:
        """This rank's batches as `(start, stop)` positions in the order."""
        size, replicas, rank = self.batch_size, self.num_replicas, self.rank
        full, rest = divmod(self._total(), replicas * size)
        spans = [(k * replicas * size + rank * size, k * replicas * size + (rank + 1) * size) for k in range(full)]
        base, extra = divmod(rest, replicas)
        start = full * replicas * size + rank * base + min(rank, extra)
        if base + (rank < extra):
            spans.append((start, start + base + (rank < extra)))
        return spans

    @property
    def batches_per_rank(self) -> int:
        """How many batches every rank iterates (its own, then empty ones)."""
        return math.ceil(self._total() / (self.num_replicas * self.batch_size))

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self._spans())

    def __iter__(self) -> Iterator[int]:
        order = list(self.order)
        return iter([index for start, stop in self._spans() for index in order[start:stop]])

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the order (a shuffled order changes with it)."""
        if hasattr(self.order, "set_epoch"):
            self.order.set_epoch(epoch)


def distribute_for_evaluation(dataloader: DataLoader, num_replicas: int, rank: int, seed: int) -> DataLoader:
    """A copy of `dataloader` that loads this rank's evaluation shard (see `EvaluationSampler`; a
    stream: `GlobalStream` with `evaluation`)."""
    if isinstance(dataloader.dataset, IterableDataset):
        if shards_itself(dataloader.dataset):
            return dataloader  # the dataset decides what each rank reads
        return stream_shard(dataloader, rank, num_replicas, split=False, evaluation=True)
    batch_sampler = _plain_batch_sampler(dataloader)
    if batch_sampler is None:  # batch_size=None: every sample is a batch of its own
        sampler, size, drop_last = dataloader.sampler, 1, False
    else:
        sampler, size, drop_last = batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    order = _one_process_order(dataloader, sampler, seed)
    if order is None:
        return dataloader
    shard = EvaluationSampler(order, size, drop_last, num_replicas, rank)
    # Each rank's part of a round is at most one batch, so batching its samples by `size` cuts
    # exactly its batches: the loader keeps its batch size.
    return _rebuild(dataloader, {"sampler": shard, "batch_size": None if batch_sampler is None else size,
                                 "drop_last": False})


def _one_process_order(dataloader: DataLoader, sampler: Any, seed: int) -> Sampler[int] | None:
    """The order in which one process would see the samples, drawn alike on every rank (`None`:
    the loader is sharded already)."""
    if isinstance(sampler, DistributedSampler):
        return None
    if type(sampler) is RandomSampler and not sampler.replacement:
        return DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    if not isinstance(sampler, Sized):
        raise MisuseError(
            f"The dataloader's sampler ({type(sampler).__name__}) has no length, so Lite cannot shard it:"
            " pass setup_dataloaders(..., replace_sampler=False) and shard it yourself."
        )
    return sampler  # SequentialSampler, or the user's own, drawn alike on every rank


class EvenBatches:
    """An evaluation pass over `dataloader` (from `distribute_for_evaluation`): its batches, then
    empty ones until this rank has as many as every other rank. An empty batch has the structure
    of the rank's last batch (or of one collated sample) with 0 rows.

    It stands where the dataloader stands (its other attributes are the dataloader's), so that a
    strategy's device loader (XLA's, which marks a step per batch) sees every rank's batches alike.
    """

    def __init__(self, dataloader: DataLoader) -> None:
        self.dataloader = dataloader

    def __len__(self) -> int:
        return self.dataloader.sampler.batches_per_rank

    def __iter__(self) -> Iterator[Any]:
        missing = len(self) - len(self.dataloader)
        last = None
        for last in self.dataloader:
            yield last
        for _ in range(missing):
            yield emptied(last if last is not None else _one_sample_batch(self.dataloader))

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)


def _one_sample_batch(dataloader: DataLoader) -> Any:
    """A batch of the evaluation order's first sample, as the loader collates it."""
    index = next(iter(dataloader.sampler.order))
    return dataloader.collate_fn([dataloader.dataset[index]])


def emptied(batch: Any) -> Any:
    """`batch` with 0 rows: each tensor cut to its first 0 rows, each list of plain values (a
    collated column of strings, say) emptied, in dicts, lists, tuples, namedtuples and dataclasses."""
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else batch
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, {key: emptied(value) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(emptied(value) for value in batch))
    if isinstance(batch, (list, tuple)):
        if all(isinstance(value, (str, bytes, int, float, bool)) or value is None for value in batch):
            return type(batch)()
        return type(batch)(emptied(value) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: emptied(getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


class EvaluationPass:
    """A set-up loader's evaluation shard, and when a pass over the loader uses it.

    Args:
        dataloader: the loader sharded for evaluation (`distribute_for_evaluation`).
        applies: called when a pass starts; whether that pass is an evaluation pass.
        automatic: whether `applies` is Lite's rule (`sharding="auto"`) rather than the user's choice.
    """

    def __init__(self, dataloader: DataLoader, applies: Callable[[], bool], automatic: bool) -> None:
        self.dataloader = dataloader
        self.applies = applies
        self.automatic = automatic
        self.running = False  # a pass is under way (set by the set-up loader)


def _rebuild(dataloader: DataLoader, picking: dict[str, Any]) -> DataLoader:
    """`dataloader` made again with `picking`, the arguments that choose its samples and batches."""
    arguments = _recorded.get(dataloader)
    if arguments is not None:
        return _replay(dataloader, arguments, picking)
    kwargs = {name: getattr(dataloader, name) for name in _LOADER_ARGUMENTS if hasattr(dataloader, name)}
    if dataloader.num_workers == 0:
        kwargs.pop("prefetch_factor", None)
    kwargs.update(picking)
    dataset = kwargs.pop("dataset", dataloader.dataset)
    accepted = inspect.signature(type(dataloader).__init__).parameters
    if type(dataloader) is not DataLoader and not all(name in accepted for name in ("dataset", *kwargs)):
        raise MisuseError(
            f"Lite cannot rebuild your {type(dataloader).__name__} with a distributed sampler because its"
            " __init__ does not accept DataLoader's arguments and it was created outside run(), where Lite"
            " does not record them: create it inside run(), or pass replace_sampler=False and give it a"
            " DistributedSampler yourself."
        )
    return type(dataloader)(dataset, **kwargs)


# -- DataLoader subclasses created inside run() ----------------------------------------------------
# While `run()` executes, the arguments each DataLoader subclass is constructed with are recorded,
# so that it can be rebuilt with a distributed sampler whatever its own `__init__` takes: it is
# constructed again with the same arguments, and when its `__init__` reaches `DataLoader.__init__`
# the sampler there is replaced by this rank's. Whether to record is the run's (a context variable
# set while `run()` executes, in its thread); the record is the loader's (a weak side table, gone
# with the loader).

_Arguments = tuple[tuple[Any, ...], dict[str, Any]]
_recorded: weakref.WeakKeyDictionary[DataLoader, _Arguments] = weakref.WeakKeyDictionary()
_recording: ContextVar[bool] = ContextVar("lite_records_loader_arguments", default=False)


def _recording_new(cls: type[DataLoader], *args: Any, **kwargs: Any) -> DataLoader:
    loader = object.__new__(cls)
    if _recording.get() and cls is not DataLoader and _inherits_new(cls):
        _recorded[loader] = (args, kwargs)
    return loader


def _inherits_new(cls: type[DataLoader]) -> bool:
    """Whether `cls` leaves `__new__` to DataLoader (its own might not pass the arguments on)."""
    mro = cls.__mro__
    return all("__new__" not in vars(k) for k in mro[: mro.index(DataLoader)])


@contextmanager
def recording_loader_arguments() -> Iterator[None]:
    """Record the constructor arguments of DataLoader subclasses created in this context.

    The hook is installed on `DataLoader.__new__` the first time and then stays, idle outside any
    recording context: CPython cannot give a class back its inherited `object.__new__` once replaced.
    """
    if vars(DataLoader).get("__new__") is None:
        DataLoader.__new__ = staticmethod(_recording_new)  # type: ignore[method-assign,assignment]
    token = _recording.set(True)
    try:
        yield
    finally:
        _recording.reset(token)


def _replay(dataloader: DataLoader, arguments: _Arguments, picking: dict[str, Any]) -> DataLoader:
    """`dataloader`'s class constructed again with its recorded arguments, but with `picking`."""
    cls = type(dataloader)
    overrides = {"sampler": None, "shuffle": None, "batch_sampler": None, "batch_size": 1, "drop_last": False,
                 **picking}
    args, kwargs = arguments
    with _overriding_base_init(cls, overrides):
        return cls(*args, **kwargs)


@contextmanager
def _overriding_base_init(cls: type[DataLoader], overrides: dict[str, Any]) -> Iterator[None]:
    """While inside, the first `DataLoader.__init__` call for a new `cls` gets `overrides`."""
    original = DataLoader.__init__
    signature = inspect.signature(original)
    pending = [True]

    def init(self: DataLoader, *args: Any, **kwargs: Any) -> None:
        if pending and type(self) is cls:
            pending.clear()
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments.update(overrides)
            return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    DataLoader.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DataLoader.__init__ = original  # type: ignore[method-assign]


def with_worker_seeding(dataloader: DataLoader, rank: int) -> DataLoader:
    """Seed `random`, NumPy and torch in each worker when `seed_everything(workers=True)` ran."""
    if dataloader.num_workers == 0 or not worker_seeding_enabled():
        return dataloader
    dataloader.worker_init_fn = functools.partial(_init_worker, rank=rank, user_fn=dataloader.worker_init_fn)
    return dataloader


def _init_worker(worker_id: int, rank: int, user_fn: Callable[[int], Any] | None) -> None:
    seed_worker(worker_id, rank)
    if user_fn is not None:
        user_fn(worker_id)
