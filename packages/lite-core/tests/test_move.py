"""Moving batches: `lite.to_device` and the set-up dataloader move tensors, dataclasses (frozen too),
namedtuples and objects with `.to(device)`, nested anywhere; a batch already there is not touched.

The strategy reports the `meta` device so that a move is visible on a CPU-only machine.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict, defaultdict
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader

from lite_core import LightningLite
from lite_core.strategies import SingleDeviceStrategy

META = torch.device("meta")


class MetaDeviceStrategy(SingleDeviceStrategy):
    """One process whose device is `meta`."""

    @property
    def root_device(self) -> torch.device:
        return META


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    image: torch.Tensor
    label: int
    extras: dict[str, Any]


@dataclasses.dataclass
class Sample:
    tokens: torch.Tensor
    length: int = dataclasses.field(init=False, default=0)


class Pair(NamedTuple):
    inputs: torch.Tensor
    target: torch.Tensor


class Encoding(UserDict):  # like a tokenizer's output: a mapping that moves itself with .to()
    moved_by_its_own_to = False

    def to(self, device: torch.device) -> Encoding:
        moved = Encoding({key: value.to(device) for key, value in self.data.items()})
        moved.moved_by_its_own_to = True
        return moved


def _meta_lite() -> LightningLite:
    return LightningLite(accelerator="cpu", strategy=MetaDeviceStrategy())


def test_to_device_moves_dataclasses_frozen_ones_too() -> None:
    sample = FrozenSample(torch.ones(2), 3, {"mask": torch.zeros(2)})
    moved = _meta_lite().to_device(sample)
    assert type(moved) is FrozenSample and moved is not sample
    assert moved.image.device == META and moved.extras["mask"].device == META and moved.label == 3
    assert sample.image.device.type == "cpu", "the user's object was changed in place"
    plain = Sample(torch.ones(1))
    plain.length = 5
    moved_plain = _meta_lite().to_device(plain)
    assert moved_plain.tokens.device == META and moved_plain.length == 5


def test_to_device_moves_namedtuples_and_objects_with_a_to_method_nested_anywhere() -> None:
    batch = [Pair(torch.ones(1), torch.zeros(1)), {"encoding": Encoding(input_ids=torch.ones(3, dtype=torch.long))}]
    moved = _meta_lite().to_device(batch)
    assert type(moved[0]) is Pair and moved[0].inputs.device == META and moved[0].target.device == META
    encoding = moved[1]["encoding"]
    assert encoding.moved_by_its_own_to and encoding["input_ids"].device == META


def test_to_device_keeps_mapping_types() -> None:
    counts = defaultdict(list, {"a": torch.ones(1)})
    moved = _meta_lite().to_device({"ordered": OrderedDict(x=torch.ones(1)), "counts": counts})
    assert type(moved["ordered"]) is OrderedDict and moved["ordered"]["x"].device == META
    assert type(moved["counts"]) is defaultdict and moved["counts"].default_factory is list
    assert moved["counts"]["a"].device == META


def test_set_up_dataloader_moves_dataclass_batches() -> None:
    def collate(items: list[torch.Tensor]) -> Sample:
        return Sample(torch.stack(items))

    lite = _meta_lite()
    loader = lite.setup_dataloaders(DataLoader([torch.ones(2)] * 4, batch_size=2, collate_fn=collate))
    assert [batch.tokens.device for batch in loader] == [META, META]


def test_a_batch_already_on_the_device_is_returned_untouched() -> None:
    lite = LightningLite(accelerator="cpu")
    x, y = torch.ones(2), torch.zeros(2)
    for batch in (x, (x, y), [x, y], {"x": x, "y": y}):
        assert lite.to_device(batch) is batch
    for fixed in ((x, y), [x, y], {"x": x, "y": y}):
        loader = lite.setup_dataloaders(DataLoader(range(4), batch_size=2, collate_fn=lambda _, b=fixed: b))
        assert all(batch is fixed for batch in loader)


class DoublingStrategy(SingleDeviceStrategy):
    """Moves batches its own way (as XLA's strategy does): the loader must ask it every time."""

    moves_batches_plainly = False

    def batch_to_device(self, batch: Any) -> Any:
        return 2 * batch


def test_set_up_dataloader_uses_a_strategys_own_batch_to_device() -> None:
    lite = LightningLite(accelerator="cpu", strategy=DoublingStrategy())
    loader = lite.setup_dataloaders(DataLoader([torch.ones(1)] * 4, batch_size=2))
    assert [batch.tolist() for batch in loader] == [[[2.0], [2.0]], [[2.0], [2.0]]]
