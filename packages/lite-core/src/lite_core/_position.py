"""Where a set-up dataloader is in its run, and what a checkpoint holds to resume it exactly.

A pass over the loader is an epoch. Before each one the samplers that have `set_epoch` (e.g. a
`DistributedSampler`, whose shuffle depends on its seed and the epoch) are told the epoch, unless
the user called `set_epoch` themselves since: then the user's epoch wins and counting goes on from
it. Saved with the loader in a checkpoint: the next epoch; for torchdata's `StatefulDataLoader`
its own state (the position inside the epoch); for a sampler that shuffles with torch's default
generator (`RandomSampler` without a generator) that generator's state, which loading restores,
so that the resumed run draws the same shuffles (and the same dropout) as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import RandomSampler

from lite_core._stateful import is_stateful


class LoaderPosition:
    """The epoch bookkeeping of one set-up dataloader."""

    def __init__(self, dataloader: Any) -> None:
        self._dataloader = dataloader
        self.next_epoch = 0
        self._in_epoch = False
        self._told = self._sampler_epochs()  # what the samplers held when Lite last set them

    def _samplers(self) -> list[Any]:
        batch_sampler = getattr(self._dataloader, "batch_sampler", None)
        found = (getattr(self._dataloader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
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

    def end_epoch(self) -> None:
        self._in_epoch = False

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: the epoch the next pass runs, and the loader's own state."""
        state: dict[str, Any] = {"epoch": self.next_epoch}
        if is_stateful(self._dataloader):
            state["dataloader"] = self._dataloader.state_dict()
            if self._in_epoch:  # the next pass finishes this epoch
                state["epoch"] -= 1
        elif self._shuffles_with_default_generator():
            state["torch_rng_state"] = torch.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` (from `state_dict`)."""
        self.next_epoch = int(state["epoch"])
        if "dataloader" in state and is_stateful(self._dataloader):
            self._dataloader.load_state_dict(state["dataloader"])
        if "torch_rng_state" in state:
            torch.set_rng_state(state["torch_rng_state"])
        self._in_epoch = False
        self._told = self._sampler_epochs()

    def _shuffles_with_default_generator(self) -> bool:
        sampler = getattr(self._dataloader, "sampler", None)
        return isinstance(sampler, RandomSampler) and sampler.generator is None
