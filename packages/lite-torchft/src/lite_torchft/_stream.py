"""A set-up dataloader's part in the quorum: which global batch a step takes, and this process's share.

The loader runs in every process as it runs in one plain process (no sampler is replaced), so each
process sees the same sequence of batches. A step takes its batches from the front of what is not
yet committed:

- `split_batches=True`: one loader batch is the step's global batch; the processes alive in the
  step (every group in the quorum, every rank in each group) each take an equal slice of its rows,
  in order of `replica rank * group size + group rank`;
- otherwise: the step takes one loader batch per process alive in the step, in that order.

A step that commits advances the position past what it took; a step that does not commit takes
the same batches again, shared over the processes of the next step. So no committed step repeats
or skips a sample, and with `split_batches=True` the job computes the steps of one plain process.
The position (`epoch`, `committed`, and the states at the epoch's start of the random generators
that a pass draws its order and seeds from) travels in the state a healing group receives from a
peer: a shuffled loader started again draws the peer's order of the epoch, not a new one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map_only


class LoaderStream:
    """The committed position of one dataloader and the batches fetched past it."""

    def __init__(self, dataloader: Iterable[Any], split_batches: bool) -> None:
        self.dataloader = dataloader
        self.split_batches = split_batches
        self.epoch = 0
        self.committed = 0  # batches of this epoch that committed steps took
        self._pending: list[Any] = []  # fetched, not yet committed
        self._taken = 0  # how many of `_pending` the open step uses
        self._iterator: Iterator[Any] | None = None
        #: The states of `_generators()` when this epoch's pass began (None before it began).
        self._epoch_rng: list[torch.Tensor] | None = None
        self._pass_epoch: int | None = None  # the epoch of the pass the user's loop is in (None between passes)
        self._skip_pass = False  # resumed in a pass a heal had ended: the user's loop ends it with no batch

    # -- position ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The committed position, and the generators' states that the epoch's order came from.

        `"pass_over"`: a heal moved this stream into a later epoch while the user's loop was still
        in an earlier epoch's pass (under an algorithm the heal comes in the optimizer step, and
        the loop saves before it asks for the next batch, which ends that pass). The user's state
        then still says the earlier epoch; resumed from it, the loop must finish that pass with no
        batch and start the position's epoch with its next one, as it would have gone on."""
        position: dict[str, Any] = {"epoch": self.epoch, "committed": self.committed}
        if self._epoch_rng is not None:
            position["rng"] = list(self._epoch_rng)
        if self._skip_pass or (self._pass_epoch is not None and self._pass_epoch != self.epoch):
            position["pass_over"] = True
        return position

    def load_state_dict(self, state: dict[str, Any], resumed: bool = False) -> None:
        """Move to a committed position (a peer's, while healing; a checkpoint's, `resumed`): fetched
        batches are dropped, and the epoch's pass starts again from the generators' states it began
        with there. A checkpoint's `"pass_over"` (see `state_dict`) makes the next pass empty."""
        self.epoch, self.committed = int(state["epoch"]), int(state["committed"])
        self._epoch_rng = list(state["rng"]) if "rng" in state else None
        self._pending, self._taken, self._iterator = [], 0, None
        self._skip_pass = resumed and bool(state.get("pass_over"))

    def commit(self) -> None:
        """The open step committed: what it took is consumed."""
        self.committed += self._taken
        self._pending = self._pending[self._taken:]
        self._taken = 0

    def abort(self) -> None:
        """The open step did not commit: its batches are taken again by the next step."""
        self._taken = 0

    # -- iteration -------------------------------------------------------------------------------
    def batches(self, begin_step: Callable[[], tuple[int, int]]) -> Iterator[Any]:
        """One pass: this process's share of each step's batches until the epoch runs out.

        `begin_step` opens the step's quorum (healing this process if a peer's state is due) and
        returns this process's index among the processes alive in the step and their number.
        """
        if self._skip_pass:  # the pass a heal had ended before the checkpoint (see `state_dict`)
            self._skip_pass = False
            return
        pass_epoch = self._pass_epoch = self.epoch
        try:
            yield from self._pass(begin_step, pass_epoch)
        finally:
            self._pass_epoch = None

    def _pass(self, begin_step: Callable[[], tuple[int, int]], pass_epoch: int) -> Iterator[Any]:
        """The pass of epoch `pass_epoch` (see `batches`)."""
        self._set_epoch()
        while self.epoch == pass_epoch and self._fill(1):
            index, count = begin_step()
            if self.epoch != pass_epoch:
                break
            if not self._fill(1 if self.split_batches else count):
                break  # fewer batches left than processes: the epoch ends for everyone alike
            yield self._share(index, count)
        if self.epoch != pass_epoch:
            # A step healed this process from a peer already in a later epoch (at its quorum, or
            # in the optimizer step's sync under an algorithm): this pass is over, and the user's
            # loop moves on to its next epoch, which the peer's position starts. Nothing fetched
            # here is kept: it came in this pass's order (a stream's shuffle seeded by the old
            # epoch), and the next pass draws the peer's epoch once its epoch is set.
            self._pending, self._taken, self._iterator = [], 0, None
            return
        self.epoch += 1
        self.committed, self._pending, self._taken, self._iterator = 0, [], 0, None
        self._epoch_rng = None

    def _set_epoch(self) -> None:
        sampler = getattr(self.dataloader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)

    def _fill(self, needed: int) -> bool:
        """Fetch until `needed` uncommitted batches are there; False when the epoch runs out first."""
        if self._iterator is None:
            self._set_epoch()
            self._start_pass()
            for _ in range(self.committed):  # resume inside the epoch at the committed position
                next(self._iterator, None)
        while len(self._pending) < needed:
            batch = next(self._iterator, _END)
            if batch is _END:
                return False
            self._pending.append(batch)
        return True

    def _start_pass(self) -> None:
        """`iter(dataloader)` as the epoch's pass first drew it: from the generators' states it
        began with (this process's own at a fresh epoch, a peer's after healing)."""
        generators = _generators(self.dataloader)
        if self._epoch_rng is None or len(self._epoch_rng) != len(generators):
            self._epoch_rng = [generator.get_state() for generator in generators]
        else:
            for generator, state in zip(generators, self._epoch_rng):
                generator.set_state(state)
        self._iterator = iter(self.dataloader)

    def _share(self, index: int, count: int) -> Any:
        if self.split_batches:
            self._taken = 1
            return tree_map_only(torch.Tensor, lambda rows: torch.tensor_split(rows, count)[index], self._pending[0])
        self._taken = count
        return self._pending[index]


def _generators(dataloader: Any) -> list[torch.Generator]:
    """The random generators one pass of `dataloader` draws from: its own `generator` and its
    sampler's (a `DataLoader` draws its workers' base seed from the first, a `RandomSampler` its
    order from the second), torch's default generator where either is missing."""
    owners = (dataloader, getattr(dataloader, "sampler", None))
    found = [getattr(owner, "generator", None) for owner in owners if hasattr(owner, "generator")]
    generators: list[torch.Generator] = []
    for generator in (*found, torch.default_generator if None in found or not found else None):
        if isinstance(generator, torch.Generator) and all(generator is not seen for seen in generators):
            generators.append(generator)
    return generators


_END = object()
