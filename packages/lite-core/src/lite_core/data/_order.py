"""The job's global sample order, and samplers that resume it at any sample on any number of processes.

An epoch has one order: the indices one plain process would draw. Each sampler here holds `skip`,
how many samples at the start of that order were consumed before the pass now running, and skips
them by index, never by fetching a sample. Three ways to split the order over processes:

- `EpochOrder`: the user's own sampler on one process (or the global order of `SplitBatches`);
- `ResumableDistributedSampler` / `ShardedSampler`: rank `r` of `W` takes every `W`-th index of
  what is left, so after `k` batches of `b` on every rank the consumed samples are the first
  `k * b * W` of the order, whatever `W` was;
- `SplitBatches`: the one-process batches, each cut into contiguous parts, one per process
  (`rank_slice`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, Sampler, SequentialSampler


def rank_slice(indices: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """Process `dp_rank`'s contiguous part of one global batch split over `dp_size` processes.

    A full batch splits into equal parts; a shorter one (the epoch's last) into parts that
    differ by at most one sample, the first ones larger, so every index is taken once.
    """
    base, extra = divmod(len(indices), dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return indices[start:start + base + (dp_rank < extra)]


def _strided(order: list[int], skip: int, num_replicas: int, rank: int, drop_last: bool) -> list[int]:
    """Rank `rank`'s indices of what is left of `order` after `skip`, as `DistributedSampler` splits
    an order: every `num_replicas`-th, padded from the epoch's start (or cut, with `drop_last`)
    so that every rank has as many."""
    left = order[skip:]
    if drop_last:
        left = left[: len(left) - len(left) % num_replicas]
    else:
        missing = -len(left) % num_replicas
        while missing and order:
            left += order[:missing]
            missing = -len(left) % num_replicas
    return left[rank::num_replicas]


def _strided_length(total: int, num_replicas: int, drop_last: bool) -> int:
    return total // num_replicas if drop_last else math.ceil(total / num_replicas)


class ResumableDistributedSampler(DistributedSampler):
    """torch's `DistributedSampler` (the epoch's permutation from `seed + epoch`) that starts the
    epoch `skip` samples into that permutation; `skip=0` draws exactly what `DistributedSampler` does."""

    skip = 0

    def _order(self) -> list[int]:
        size = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(_strided(self._order(), self.skip, self.num_replicas, self.rank, self.drop_last))

    def __len__(self) -> int:
        return _strided_length(self.order_length() - self.skip, self.num_replicas, self.drop_last)

    def order_length(self) -> int:
        """How many samples the epoch's order holds."""
        return len(self.dataset)  # type: ignore[arg-type]

    def order_state(self) -> dict[str, Any]:
        """What reproduces this epoch's order: the seed (the epoch is saved beside it)."""
        return {"seed": self.seed}

    def restore_order(self, state: dict[str, Any]) -> None:
        if "seed" in state:
            self.seed = int(state["seed"])

    @property
    def reproducible(self) -> bool:
        return True


class ForwardsEpoch:
    """`epoch` and `set_epoch` passed on to the `source` it wraps, where the source has them (a
    sampler's or a stream's epoch, e.g. to seed its shuffle)."""

    source: Any

    @property
    def epoch(self) -> Any:
        return getattr(self.source, "epoch", None)

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the source when it uses one."""
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)


class EpochOrder(ForwardsEpoch, Sampler[int]):
    """The order in which one plain process draws `source`'s indices, starting `skip` samples in.

    At the start of each pass it keeps what reproduces that pass's order: the seed a
    `RandomSampler` without a generator draws from torch's default generator (drawn the same way,
    so that generator moves as in a plain run), the state of a sampler's own `generator`, or a
    stateful sampler's `state_dict()`. `restore_order` hands it back for the next pass, which then
    draws the same order again instead of a new one; a `torch_rng_state` in it is restored when
    that pass starts drawing, so torch's default generator then stands where it stood in the
    interrupted run when its checkpoint was saved.
    """

    def __init__(self, source: Sampler[int]) -> None:
        self.source = source
        self.skip = 0
        self._state: dict[str, Any] = {}
        self._restored: dict[str, Any] | None = None

    def __len__(self) -> int:
        return max(self.order_length() - self.skip, 0)

    def order_length(self) -> int:
        """How many samples the epoch's order holds."""
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        restored, self._restored = self._restored, None
        indices = self._draw(restored or {})
        return itertools.islice(indices, self.skip, None) if self.skip else indices

    def _draw(self, restored: dict[str, Any]) -> Iterator[int]:
        source = self.source
        if "torch_rng_state" in restored:  # here, after the loader's iterator drew its workers' base seed
            torch.set_rng_state(restored["torch_rng_state"])
        if type(source) is RandomSampler and source.generator is None:
            seed = restored.get("seed")
            if seed is None:  # what RandomSampler itself draws at the start of a pass
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
            self._state = {"seed": int(seed)}
            generator = torch.Generator().manual_seed(int(seed))
            return iter(RandomSampler(source.data_source, source.replacement, source._num_samples, generator))
        generator = getattr(source, "generator", None)
        if isinstance(generator, torch.Generator):
            if "generator" in restored:
                generator.set_state(restored["generator"])
            self._state = {"generator": generator.get_state()}
        elif _has_state(source):
            if "sampler" in restored:
                source.load_state_dict(restored["sampler"])  # type: ignore[attr-defined]
            self._state = {"sampler": source.state_dict()}  # type: ignore[attr-defined]
        return iter(source)

    def order_state(self) -> dict[str, Any]:
        """What reproduces the order of the pass under way (see the class docstring)."""
        return dict(self._state)

    def restore_order(self, state: dict[str, Any]) -> None:
        self._restored = dict(state)

    @property
    def reproducible(self) -> bool:
        """Whether Lite knows how to draw this pass's order again (else it assumes the source
        draws the same order for the same epoch)."""
        source = self.source
        return (isinstance(source, (RandomSampler, SequentialSampler, DistributedSampler))
                or isinstance(getattr(source, "generator", None), torch.Generator)
                or _has_state(source) or hasattr(source, "set_epoch"))


def _has_state(sampler: Any) -> bool:
    return callable(getattr(sampler, "state_dict", None)) and callable(getattr(sampler, "load_state_dict", None))


class ShardedSampler(Sampler[int]):
    """Gives rank `r` every `num_replicas`-th index of the user's sampler, starting at `r`.

    Every rank draws the same sequence from the user's sampler (so it must be deterministic
    for a given epoch); with `drop_last=False` the sequence is padded by repeating its start so
    that all ranks see the same number of samples. The first `skip` indices of the sequence
    were consumed before this pass. Lite hands it the user's sampler inside an `EpochOrder`, so
    that a sampler with its own generator or state draws the same sequence again on resume.
    """

    def __init__(self, sampler: Sampler[int], num_replicas: int, rank: int, drop_last: bool = False) -> None:
        self.sampler = sampler
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.skip = 0

    def __len__(self) -> int:
        return _strided_length(self.order_length() - self.skip, self.num_replicas, self.drop_last)

    def order_length(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(_strided(list(self.sampler), self.skip, self.num_replicas, self.rank, self.drop_last))

    def order_state(self) -> dict[str, Any]:
        return self.sampler.order_state() if isinstance(self.sampler, EpochOrder) else {}

    def restore_order(self, state: dict[str, Any]) -> None:
        if isinstance(self.sampler, EpochOrder):
            self.sampler.restore_order(state)

    @property
    def reproducible(self) -> bool:
        inner = self.sampler
        return inner.reproducible if isinstance(inner, EpochOrder) else hasattr(inner, "set_epoch")

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the user's sampler when it uses one."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


#: Which part of each global batch this process takes: `() -> (dp_rank, dp_size)`, asked per batch.
BatchPart = Callable[[], "tuple[int, int]"]


class SplitBatches(Sampler[list[int]]):
    """This process's part of each batch that `batches` (the one-process batch sampler) yields.

    `part()` says, for each batch, which part this process takes and of how many
    (`rank_slice`); a strategy whose number of data-parallel replicas changes between steps
    answers differently from one batch to the next.

    Args:
        batches: the global batches, a `BatchSampler` over an `EpochOrder`.
        part: `() -> (dp_rank, dp_size)`.
    """

    def __init__(self, batches: BatchSampler, part: BatchPart) -> None:
        self.batches = batches
        self.part = part

    @property
    def sampler(self) -> EpochOrder:
        """The global order the batches are cut from."""
        return self.batches.sampler  # type: ignore[return-value]

    @property
    def global_batch_size(self) -> int:
        return self.batches.batch_size

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        part = self.part
        for indices in self.batches:
            yield rank_slice(indices, *part())


def positioned_sampler(dataloader: Any) -> Any:
    """The sampler of `dataloader` that holds its place in the global order (`None`: none does)."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, (EpochOrder, ResumableDistributedSampler, ShardedSampler)):
            return sampler
    return None


def samples_per_batch(dataloader: Any, sampler: Any) -> int:
    """How many samples of the global order one batch of `dataloader` takes on all processes together."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if isinstance(batch_sampler, SplitBatches):
        return batch_sampler.global_batch_size
    per_rank = batch_sampler.batch_size if batch_sampler is not None else 1
    return per_rank * getattr(sampler, "num_replicas", 1)
