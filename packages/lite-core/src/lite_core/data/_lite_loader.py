"""The set-up dataloader: the user's loader (or Lite's copy of it), its batches moved to the device,
and its place in the job's global sample order (`lite_core.data._position`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor
from torch.utils.data import DataLoader

from lite_core.data._sharding import EvaluationPass, EvaluationSampler, EvenBatches
from lite_core.move import already_on, move_to_device
from lite_core.data._position import LoaderPosition

_OWN = ("_dataloader", "_strategy", "_moves_plainly", "_position", "_evaluation", "_evaluation_position")


class LiteDataLoader(DataLoader):
    """Iterates the user's dataloader, moving each batch to the device.

    It is a `DataLoader` (`isinstance(loader, DataLoader)` holds, as libraries check) whose
    attributes (`dataset`, `batch_size`, `sampler`, ...) are those of the loader Lite iterates;
    it never runs `DataLoader.__init__` itself.

    Calls `set_epoch` on a sampler that has it before each pass, so shuffling differs per epoch
    (a `set_epoch` the user called since wins). `state_dict()`/`load_state_dict()` carry its
    global position through a checkpoint (epoch, the epoch's order, samples consumed), so a run
    resumed under any strategy and number of processes goes on at the next sample.

    With an `evaluation` shard (distributed strategies), a pass that it `applies` to iterates that
    shard instead: every sample once, and as many batches as every other rank (the last ones
    possibly empty); see `LightningLite.setup_dataloaders`. `moves_plainly` says that the
    strategy moves batches the default way (`Strategy.batch_to_device`), which lets the loader
    pass batches already on the device through untouched. `strategy` (a `Strategy`, handed in:
    this module sits below the strategies) moves the batches; `None` leaves them where they are.
    """

    def __init__(self, dataloader: DataLoader, strategy: Any,
                 evaluation: EvaluationPass | None = None, moves_plainly: bool = False) -> None:
        self._dataloader = dataloader
        self._strategy = strategy
        self._moves_plainly = moves_plainly  # the strategy's batch_to_device is Strategy's own
        self._position = LoaderPosition(dataloader, strategy)
        self._evaluation = evaluation
        self._evaluation_position = None if evaluation is None else LoaderPosition(evaluation.dataloader)

    @property
    def dataloader(self) -> DataLoader:
        """The dataloader Lite iterates (the user's, or a copy with a distributed sampler)."""
        return self._dataloader

    def __len__(self) -> int:
        evaluation = self._evaluation
        if evaluation is not None and evaluation.applies():
            sampler = evaluation.dataloader.sampler
            if isinstance(sampler, EvaluationSampler):
                return sampler.batches_per_rank
            return len(evaluation.dataloader)  # a stream's cut: as many batches on every rank already
        return len(self._dataloader)

    def state_dict(self) -> dict[str, Any]:
        """The loader's global position: the epoch, what reproduces its order, and how many of its
        samples were consumed (see `lite_core.data._position`)."""
        return self._position.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the position `state_dict()` returned (saved under any number of processes)."""
        self._position.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[Any]:
        evaluation = self._evaluation
        if evaluation is not None and evaluation.applies():
            return self._evaluation_pass(evaluation)
        return self._batches(self._dataloader, self._position)

    def _evaluation_pass(self, evaluation: EvaluationPass) -> Iterator[Any]:
        evaluation.running = True
        try:
            loader = evaluation.dataloader
            even = EvenBatches(loader) if isinstance(loader.sampler, EvaluationSampler) else loader  # a stream's is
            yield from self._batches(even, self._evaluation_position)
        finally:
            evaluation.running = False

    def _batches(self, dataloader: DataLoader | EvenBatches, position: LoaderPosition) -> Iterator[Any]:
        # One generator for the whole pass (no nested one): it runs once per batch. A batch
        # counts as consumed once it is handed out (a save during its step resumes after it).
        position.start_epoch()
        if self._strategy is None:
            for batch in dataloader:
                position.taken += 1
                yield batch
        elif not self._moves_plainly:
            move = self._strategy.batch_to_device
            for batch in self._strategy.process_dataloader(dataloader):
                position.taken += 1
                yield move(batch)
        else:
            # The strategy moves batches the default way: look the device up once per epoch, and
            # pass batches that are already there (every batch on CPU) through untouched.
            device = self._strategy.root_device
            for batch in self._strategy.process_dataloader(dataloader):
                position.taken += 1
                # one tensor on the device, the common case, is checked inline: without a call
                on_device = (type(batch) is Tensor and batch.device == device) or already_on(batch, device)
                yield batch if on_device else move_to_device(batch, device)
        position.end_epoch()

    def __getattr__(self, name: str) -> Any:
        if name in _OWN:
            raise AttributeError(name)
        return getattr(self._dataloader, name)

    def __repr__(self) -> str:
        return f"LiteDataLoader({self._dataloader!r})"
