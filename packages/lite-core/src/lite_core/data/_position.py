"""Where a set-up dataloader is in the job's global sample order, and what a checkpoint holds to resume it.

A pass over the loader is an epoch. Before each one the samplers that have `set_epoch` (e.g. a
`DistributedSampler`, whose shuffle depends on its seed and the epoch) are told the epoch, unless
the user called `set_epoch` themselves since: then the user's epoch wins and counting goes on from
it.

The position saved with the loader is global, never per rank: the epoch, what reproduces that
epoch's order (its seed, or the generator's state at its start; see `lite_core.data._order`), and how
many samples of that order were consumed, counted from the batches handed to the user (not those
that workers prefetched). Loading it under any strategy and number of processes makes the next
batch the one that the uninterrupted run would have drawn next: the sampler skips the consumed
indices without fetching them. For a sampler that shuffles with torch's default generator the
generator's state is saved as well, which loading restores, so that the resumed run draws the same
shuffles (and the same dropout) as the uninterrupted one. A loader whose sampler Lite does not
hold (`replace_sampler=False`, a stream that shards itself) resumes at its epoch, or from its own
state (torchdata's `StatefulDataLoader`). A stream Lite cuts into global batches
(`lite_core.data._streams.GlobalStream`) saves how many samples of the stream the consumed global
batches held; its next pass starts that many samples in (`lite_core.data._streams`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import IterableDataset, RandomSampler

from lite_core._user_frame import warn_user
from lite_core.checkpoint._stateful import is_stateful
from lite_core.data._order import EpochOrder, SplitBatches, positioned_sampler, samples_per_batch
from lite_core.data._streams import GlobalStream


class LoaderPosition:
    """The epoch and sample bookkeeping of one set-up dataloader."""

    def __init__(self, dataloader: Any, strategy: Any = None) -> None:
        self._dataloader = dataloader
        # Asked where a strategy keeps the position itself (`Strategy.loader_batches_consumed`,
        # `Strategy.resume_loader`): then it, not this object, owns the batches consumed.
        self._strategy = strategy
        self._sampler = positioned_sampler(dataloader)
        self._per_batch = samples_per_batch(dataloader, self._sampler) if self._sampler is not None else 0
        stream = getattr(dataloader, "dataset", None)
        self._stream = stream if isinstance(stream, GlobalStream) else None  # a stream Lite cuts into rounds
        # a stream's own set_epoch (a shuffle buffer's seed); one that shards itself is a copy the user cannot reach
        self._epoch_stream = stream if isinstance(stream, IterableDataset) and hasattr(stream, "set_epoch") else None
        self.next_epoch = 0
        self.taken = 0  # batches handed out in the pass under way (the set-up loader counts them)
        self._pass_skip = 0
        self._in_epoch = False
        self._loaded: dict[str, Any] | None = None  # a mid-epoch position loaded, its pass not begun
        self._told = self._sampler_epochs()  # what the samplers held when Lite last set them

    def _samplers(self) -> list[Any]:
        batch_sampler = getattr(self._dataloader, "batch_sampler", None)
        found = (getattr(self._dataloader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None),
                 self._epoch_stream)
        unique = {id(s): s for s in found if hasattr(s, "set_epoch")}  # a BatchSampler holds the loader's sampler
        return list(unique.values())

    def _sampler_epochs(self) -> list[Any]:
        return [getattr(s, "epoch", None) for s in self._samplers()]

    def start_epoch(self) -> None:
        """Tell the samplers the epoch that starts now (the user's own `set_epoch` wins)."""
        samplers, now = self._samplers(), self._sampler_epochs()
        changed = [epoch for epoch, told in zip(now, self._told) if epoch is not None and epoch != told]
        if changed:
            self.next_epoch = changed[0]
        for sampler in samplers:
            sampler.set_epoch(self.next_epoch)
        self._told = self._sampler_epochs()
        self.next_epoch += 1
        self._in_epoch = True
        if self._sampler is not None:
            if self._loaded is None:
                self._sampler.skip = 0
            self._pass_skip = self._sampler.skip
        elif self._stream is not None:
            if self._loaded is None:
                self._stream.skip = 0
            self._pass_skip = self._stream.skip
        self._loaded = None
        self.taken = 0

    def end_epoch(self) -> None:
        self._in_epoch = False
        if self._sampler is not None:
            self._sampler.skip = 0
        elif self._stream is not None:
            self._stream.skip = 0

    def processes(self) -> int:
        """How many processes split the order (the data-parallel size)."""
        batch_sampler = getattr(self._dataloader, "batch_sampler", None)
        if isinstance(batch_sampler, SplitBatches):
            return batch_sampler.part()[1]
        if self._stream is not None:
            return self._stream.dp_size
        return getattr(self._sampler, "num_replicas", 1)

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: the epoch, its order and the samples of it consumed."""
        if self._loaded is not None:
            return dict(self._loaded)
        state: dict[str, Any] = {"epoch": self.next_epoch}
        if self._sampler is not None:
            state["processes"] = self.processes()
            state["samples_per_step"] = self._per_batch  # the global batch, for the warning at load
            if self._in_epoch:  # the next pass finishes this epoch
                state["epoch"] -= 1
                consumed = self._consumed()
                state["consumed"] = min(consumed, self._sampler.order_length())
                state["order"] = self._sampler.order_state()
                state["processes"] = self.processes()
        elif self._stream is not None:
            if self._in_epoch:  # samples of the stream that the rounds handed out so far held
                state["epoch"] -= 1
                batches = self._strategy_batches()
                taken = self.taken if batches is None else batches  # the strategy's count: committed steps only
                state["consumed"] = (0 if batches is not None else self._pass_skip) + taken * self._stream.round_size
                state["stream"] = True
                state["processes"] = self.processes()
        elif is_stateful(self._dataloader):
            state["dataloader"] = self._dataloader.state_dict()
            if self._in_epoch:
                state["epoch"] -= 1
        elif self._in_epoch:
            state["epoch"] -= 1
            batches = self._strategy_batches()
            if batches is not None:  # a strategy that keeps the position (`ddp_ft`'s stream) skips them itself
                state["consumed"], state["strategy_batches"] = batches, True
            else:
                state["consumed"] = self.taken  # batches, for the warning at load: this loader cannot skip
        if self._shuffles_with_default_generator():
            state["torch_rng_state"] = torch.get_rng_state()
        return state

    def _strategy_batches(self) -> int | None:
        """The batches of the pass under way that the strategy counted, where it keeps the position."""
        return None if self._strategy is None else self._strategy.loader_batches_consumed(self._dataloader)

    def _consumed(self) -> int:
        """Samples of the pass under way consumed: counted by the strategy where it keeps them."""
        batches = self._strategy_batches()
        if batches is not None:
            return batches * self._per_batch
        return self._pass_skip + self.taken * self._per_batch

    def _strategy_took(self, consumed: int, per_batch: int) -> bool:
        """Whether the strategy took the position, `consumed // per_batch` committed batches into the
        epoch: it then skips them itself, so the sampler or the stream must not skip them as well."""
        if self._strategy is None or not consumed or not per_batch or consumed % per_batch:
            return False
        return bool(self._strategy.resume_loader(self._dataloader, self.next_epoch, consumed // per_batch))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` (from `state_dict`)."""
        self.next_epoch = int(state["epoch"])
        consumed = int(state.get("consumed", 0))
        self._loaded = None
        rng_state = state.get("torch_rng_state")
        if self._sampler is not None:
            self._warn_if_global_batch_changes(state)
            self._sampler.skip = 0 if self._strategy_took(consumed, self._per_batch) else consumed
            order = dict(state.get("order", {}))
            if consumed and rng_state is not None and isinstance(self._sampler, EpochOrder):
                order["torch_rng_state"], rng_state = rng_state, None  # restored where the pass draws
            self._sampler.restore_order(order)
            if consumed:
                self._loaded = dict(state)
                self._warn_if_not_reproducible(state)
        elif self._stream is not None and (state.get("stream") or not consumed):
            # Where the strategy keeps the position (`ddp_ft`'s stream skips the committed batches
            # itself), the cut must not skip them as well.
            self._stream.skip = 0 if self._strategy_took(consumed, self._stream.round_size) else consumed
            self._loaded = dict(state) if consumed else None
            if getattr(self._dataloader, "_iterator", None) is not None:
                self._dataloader._iterator = None  # persistent workers hold copies of the stream: start new ones
        elif "dataloader" in state and is_stateful(self._dataloader):
            self._dataloader.load_state_dict(state["dataloader"])
        elif consumed:
            # A strategy that keeps the position re-reads the epoch and skips what committed steps took.
            taken = bool(state.get("strategy_batches")) and self._strategy_took(consumed, 1)
            if not taken:
                warn_user(
                    f"This dataloader was saved {consumed} batches into epoch {self.next_epoch}, but Lite does not"
                    " hold its sampler (replace_sampler=False, a stream that shards itself, or a loader it could not"
                    " rebuild), so the epoch starts again from its first sample: let Lite shard the loader to resume"
                    " inside it."
                )
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        self._in_epoch = False
        self._told = self._sampler_epochs()

    def _warn_if_global_batch_changes(self, state: dict[str, Any]) -> None:
        """Per-rank batches saved on another number of processes make another global batch, so
        the resumed run takes another number of steps than the schedule it saved was sized for."""
        before, now = state.get("processes"), self.processes()
        samples_before = state.get("samples_per_step")
        if before is None or samples_before is None or before == now or samples_before == self._per_batch:
            return
        if isinstance(getattr(self._dataloader, "batch_sampler", None), SplitBatches):
            return
        warn_user(
            f"This dataloader was saved on {before} processes taking {samples_before} samples per step, and"
            f" resumes on {now} taking {self._per_batch}, so every step sees another global batch and the epoch"
            " has another number of steps than an LR schedule sized for the saved run expects (OneCycleLR's"
            " total_steps): set the loader up with setup_dataloaders(..., split_batches=True) to keep the"
            " global batch on any number of processes, or size the schedule for the new run."
        )

    def _warn_if_not_reproducible(self, state: dict[str, Any]) -> None:
        if self._sampler.reproducible:
            return
        inner = getattr(self._sampler, "sampler", self._sampler)  # inside a ShardedSampler
        inner = getattr(inner, "source", inner)  # inside an EpochOrder
        before, now = state.get("processes", 1), self.processes()
        shape = f" on {before} processes (now {now})" if before != now else ""
        warn_user(
            f"The dataloader's sampler ({type(inner).__name__}) has no set_epoch(), state_dict() or generator,"
            f" so Lite cannot draw its order again: the resumed epoch skips the first {state.get('consumed')}"
            f" indices{shape} of its next pass, which repeats or skips samples unless that pass draws the same"
            " order; give the sampler state_dict() and load_state_dict()."
        )

    def _shuffles_with_default_generator(self) -> bool:
        sampler = getattr(self._dataloader, "sampler", None)
        if isinstance(self._sampler, EpochOrder):
            sampler = self._sampler.source
        return isinstance(sampler, RandomSampler) and sampler.generator is None
