"""Evaluation passes: shards without repeats, equal batch counts, `gather_for_metrics` on one device.

The shards are checked rank by rank in one process; the multi-process runs (every strategy, 2
and 3 processes, the three loops users write) are `tests/matrix/test_evaluation.py`.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lite_core import LightningLite
from lite_core.data._sharding import EvaluationSampler, EvenBatches, distribute_for_evaluation, emptied
from lite_core.errors import MisuseError


def _rank_batches(loader: DataLoader, replicas: int, rank: int, seed: int = 0) -> list[list[int]]:
    sharded = distribute_for_evaluation(loader, replicas, rank, seed)
    return [batch.tolist() for batch in EvenBatches(sharded)]


@pytest.mark.parametrize(("samples", "batch", "replicas"), [(11, 4, 2), (9, 4, 2), (11, 4, 3), (1, 4, 2),
                                                            (2, 4, 3), (12, 4, 2), (17, 3, 4)])
def test_every_sample_once_in_the_one_process_order_and_equal_batch_counts(samples: int, batch: int,
                                                                           replicas: int) -> None:
    data = list(range(samples))
    ranks = [_rank_batches(DataLoader(data, batch_size=batch), replicas, r) for r in range(replicas)]
    assert len({len(batches) for batches in ranks}) == 1  # per-batch collectives line up
    in_rank_order = [i for step in zip(*ranks) for batches in step for i in batches]
    assert in_rank_order == data  # none repeated, none missing, batch by batch in the one-process order
    assert all(len(b) <= batch for batches in ranks for b in batches)


def test_nine_samples_over_two_ranks_leave_rank_one_an_empty_last_batch() -> None:
    # the case: ranks would hold different numbers of batches (a padded sampler repeats sample 0)
    loader = DataLoader(list(range(9)), batch_size=4)
    assert [_rank_batches(loader, 2, r) for r in range(2)] == [[[0, 1, 2, 3], [8]], [[4, 5, 6, 7], []]]


def test_drop_last_keeps_what_one_process_keeps() -> None:
    loader = DataLoader(list(range(14)), batch_size=4, drop_last=True)
    ranks = [_rank_batches(loader, 2, r) for r in range(2)]
    assert sorted(i for batches in ranks for b in batches for i in b) == list(range(12))


def test_a_shuffled_order_is_drawn_alike_on_every_rank_and_changes_with_the_epoch() -> None:
    loader = DataLoader(list(range(20)), batch_size=3, shuffle=True)
    shards = [distribute_for_evaluation(loader, 2, r, seed=5) for r in range(2)]
    first = [list(s.sampler) for s in shards]
    assert sorted(first[0] + first[1]) == list(range(20))
    for shard in shards:
        shard.sampler.set_epoch(1)
    assert [list(s.sampler) for s in shards] != first
    assert sorted(list(shards[0].sampler) + list(shards[1].sampler)) == list(range(20))


def test_a_user_distributed_sampler_is_left_alone() -> None:
    loader = DataLoader(list(range(5)), sampler=DistributedSampler(list(range(5)), num_replicas=2, rank=0))
    assert distribute_for_evaluation(loader, 2, 0, 0) is loader


Point = namedtuple("Point", "x y")


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    names: list[str]


def test_an_empty_batch_keeps_the_structure_with_zero_rows() -> None:
    batch = {"x": torch.ones(3, 2), "pair": Point(torch.ones(3), torch.zeros(3, 5)), "names": ["a", "b", "c"],
             "data": Batch(torch.ones(3, 4), ["a", "b", "c"]), "scale": torch.tensor(2.0)}
    empty = emptied(batch)
    assert empty["x"].shape == (0, 2) and isinstance(empty["pair"], Point) and empty["pair"].y.shape == (0, 5)
    assert empty["names"] == [] and empty["data"].inputs.shape == (0, 4) and empty["data"].names == []
    assert empty["scale"].item() == 2.0  # a 0-dim tensor has no rows to drop


def test_a_rank_without_samples_gets_an_empty_batch_like_the_others() -> None:
    data = [(torch.full((3,), float(i)), i) for i in range(1)]
    loader = distribute_for_evaluation(DataLoader(data, batch_size=4), 2, 1, 0)
    assert len(loader) == 0 and isinstance(loader.sampler, EvaluationSampler)
    (x, y), = EvenBatches(loader)
    assert x.shape == (0, 3) and y.shape == (0,) and y.dtype == torch.int64


class _PretendRankOneOfTwo(LightningLite):
    """One process that shards as rank 1 of 2 would (the strategy's sampler arguments say so)."""

    def __init__(self) -> None:
        super().__init__(accelerator="cpu", strategy="single_device")
        self.strategy.distributed_sampler_kwargs = lambda: {"num_replicas": 2, "rank": 1}  # type: ignore[method-assign]


def _samples(loader: Any) -> list[int]:
    return [i for batch in loader for i in batch.tolist()]


def test_a_pass_without_gradients_or_with_every_model_in_eval_mode_is_an_evaluation_pass() -> None:
    lite = _PretendRankOneOfTwo()
    model = lite.setup(nn.Linear(1, 1))
    loader = lite.setup_dataloaders(DataLoader(list(range(9)), batch_size=4))
    padded = [1, 3, 5, 7, 0]  # training: DistributedSampler repeats sample 0 so both ranks hold 5
    assert _samples(loader) == padded and len(loader) == 2
    with torch.no_grad():
        assert _samples(loader) == [4, 5, 6, 7] and len(loader) == 2  # then an empty batch
        assert [len(batch) for batch in loader] == [4, 0]
    with torch.inference_mode():
        assert _samples(loader) == [4, 5, 6, 7]
    model.eval()
    assert _samples(loader) == [4, 5, 6, 7]
    model.train()
    assert _samples(loader) == padded


@pytest.mark.parametrize(("sharding", "expected"), [("training", [1, 3, 5, 7, 0]), ("evaluation", [4, 5, 6, 7])])
def test_the_sharding_can_be_chosen(sharding: str, expected: list[int]) -> None:
    lite = _PretendRankOneOfTwo()
    loader = lite.setup_dataloaders(DataLoader(list(range(9)), batch_size=4), sharding=sharding)
    assert _samples(loader) == expected
    with torch.no_grad():
        assert _samples(loader) == expected


def test_an_unknown_sharding_is_refused() -> None:
    lite = LightningLite(accelerator="cpu")
    with pytest.raises(MisuseError, match=r"sharding='eval'.*'auto', 'training', 'evaluation'"):
        lite.setup_dataloaders(DataLoader([1, 2]), sharding="eval")


class _TrainsInEvalMode(LightningLite):
    def run(self) -> str:
        model = nn.Linear(1, 1)
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = self.setup_dataloaders(DataLoader(torch.ones(4, 1), batch_size=2))
        model.eval()  # e.g. to freeze dropout and batch norm while training
        for x in loader:
            try:
                self.backward(model(x).sum())
            except MisuseError as err:
                return str(err)
        return "no error"


@pytest.mark.timeout(60)
def test_backward_inside_a_pass_taken_for_evaluation_says_how_to_train() -> None:
    message = _TrainsInEvalMode(accelerator="cpu", strategy="ddp", devices=1).run()
    assert "sharded for evaluation" in message and "sharding='training'" in message


def test_gather_for_metrics_on_one_device_returns_tensors_with_rows() -> None:
    lite = LightningLite(accelerator="cpu")
    pred = torch.arange(6.0).reshape(3, 2)
    gathered = lite.gather_for_metrics({"pred": pred, "loss": torch.tensor(0.5), "n": 3, "pair": (True, [1.5])})
    assert torch.equal(gathered["pred"], pred) and gathered["pred"] is not pred
    assert gathered["loss"].shape == (1,) and gathered["n"].tolist() == [3]
    assert gathered["pair"][0].tolist() == [1] and gathered["pair"][1][0].tolist() == [1.5]


@pytest.mark.parametrize(("data", "kind"), [("text", "str"), (object(), "object"),
                                            ({"a": [torch.ones(1), None]}, "NoneType")])
def test_gather_for_metrics_names_what_it_cannot_send(data: Any, kind: str) -> None:
    lite = LightningLite(accelerator="cpu")
    with pytest.raises(MisuseError, match=rf"^gather_for_metrics\(\) cannot send a value of type {kind}: pass tensors"):
        lite.gather_for_metrics(data)


class _NamedLoader(DataLoader):
    def __init__(self, data: Any, name: str, batch_size: int) -> None:
        self.name = name
        super().__init__(data, batch_size=batch_size, shuffle=True)


def test_a_dataloader_subclass_created_inside_run_is_rebuilt_for_evaluation() -> None:
    from lite_core.data._sharding import recording_loader_arguments

    with recording_loader_arguments():  # what run() does around the user's code
        loader = _NamedLoader(list(range(9)), "mine", batch_size=4)
    shards = [distribute_for_evaluation(loader, 2, rank, seed=1) for rank in range(2)]
    assert all(type(s) is _NamedLoader and s.name == "mine" and s.batch_size == 4 for s in shards)
    seen = [[i for batch in EvenBatches(s) for i in batch.tolist()] for s in shards]
    assert sorted(seen[0] + seen[1]) == list(range(9)) and seen[0] != list(range(5))  # shuffled, once each
