"""Collectives on one process: Python numbers and nested containers in, tensors on `lite.device` out.

`MetaDeviceStrategy` is a real one-process strategy whose device is `meta`: on a CPU-only machine
it is the only way to see that Lite moves a CPU tensor to the strategy's device before a
collective, as it must for NCCL. The 2-process behaviour is in tests/integration.
"""

from __future__ import annotations

import pytest
import torch

from lite_core import LightningLite
from lite_core.strategies import SingleDeviceStrategy

META = torch.device("meta")


class MetaDeviceStrategy(SingleDeviceStrategy):
    """One process whose device is `meta`."""

    @property
    def root_device(self) -> torch.device:
        return META


class MnistStyleEvaluation(LightningLite):
    """The test loop a user writes: a Python float summed over batches, then over processes."""

    def run(self) -> torch.Tensor:
        test_loss = 0.0
        for batch in (torch.ones(3), torch.full((3,), 2.0)):
            test_loss += float(batch.sum())
        return self.all_reduce(test_loss, reduce_op="sum")


def test_all_reduce_of_a_python_float_in_the_mnist_style_test_loop() -> None:
    result = MnistStyleEvaluation(accelerator="cpu").run()
    assert isinstance(result, torch.Tensor) and result.device == torch.device("cpu")
    assert result.item() == 9.0


@pytest.mark.parametrize("reduce_op", ["sum", "mean", "max", "min", "product"])
def test_all_reduce_turns_numbers_into_tensors(reduce_op: str) -> None:
    lite = LightningLite(accelerator="cpu")
    assert torch.equal(lite.all_reduce(1.5, reduce_op=reduce_op), torch.tensor(1.5))
    expected = torch.tensor(3.0) if reduce_op == "mean" else torch.tensor(3)
    reduced = lite.all_reduce(3, reduce_op=reduce_op)
    assert reduced.dtype == expected.dtype and torch.equal(reduced, expected)


def test_one_process_returns_new_tensors_as_a_real_collective_does() -> None:
    # Under ddp the results are new tensors and a mean is a true division; one process must not
    # differ: `total = all_reduce(correct); total /= n` would otherwise change `correct`.
    lite = LightningLite(accelerator="cpu")
    correct = torch.tensor([3, 4])
    total = lite.all_reduce(correct, reduce_op="sum")
    total += 1
    gathered = lite.all_gather(correct)
    gathered += 1
    assert torch.equal(correct, torch.tensor([3, 4]))
    mean = lite.all_reduce(correct, reduce_op="mean")
    assert mean.dtype == torch.float32 and torch.equal(mean, torch.tensor([3.0, 4.0]))
    assert lite.all_reduce(2, reduce_op="mean").dtype == torch.float32  # as `int_mean` under ddp


def test_all_gather_of_numbers_and_nested_containers() -> None:
    lite = LightningLite(accelerator="cpu")
    assert torch.equal(lite.all_gather(1.0), torch.tensor([1.0]))
    gathered = lite.all_gather({"a": torch.ones(2), "b": [2, True], "c": (torch.zeros(()), 0.5)})
    assert set(gathered) == {"a", "b", "c"}
    assert torch.equal(gathered["a"], torch.ones(1, 2))
    assert isinstance(gathered["b"], list) and isinstance(gathered["c"], tuple)
    assert torch.equal(gathered["b"][0], torch.tensor([2])) and torch.equal(gathered["b"][1], torch.tensor([1]))
    assert torch.equal(gathered["c"][0], torch.zeros(1)) and torch.equal(gathered["c"][1], torch.tensor([0.5]))


def test_all_reduce_keeps_the_structure_and_leaves_other_objects_alone() -> None:
    lite = LightningLite(accelerator="cpu")
    reduced = lite.all_reduce({"loss": 0.25, "correct": 7, "name": "val"}, reduce_op="sum")
    assert torch.equal(reduced["loss"], torch.tensor(0.25))
    assert torch.equal(reduced["correct"], torch.tensor(7))
    assert reduced["name"] == "val"


def test_broadcast_returns_python_objects_and_numbers_as_they_were_sent() -> None:
    lite = LightningLite(accelerator="cpu")
    assert lite.broadcast(1.0) == 1.0 and type(lite.broadcast(1.0)) is float
    assert lite.broadcast("text") == "text"
    payload = {"a": 1, "items": [1, 2], "t": torch.ones(2)}
    received = lite.broadcast(payload)
    assert received["a"] == 1 and received["items"] == [1, 2] and torch.equal(received["t"], torch.ones(2))


def test_collectives_move_tensors_to_the_strategys_device_first() -> None:
    lite = LightningLite(accelerator="cpu", strategy=MetaDeviceStrategy())
    assert lite.device == META
    assert lite.all_reduce(torch.ones(2), reduce_op="sum").device == META
    assert lite.all_gather(torch.ones(2)).device == META
    gathered = lite.all_gather({"x": torch.ones(1), "n": 2.0})
    assert gathered["x"].device == META and gathered["n"].device == META
    assert lite.all_reduce([1.0, torch.ones(1)])[1].device == META
    received = lite.broadcast({"t": torch.ones(1), "n": 3})
    assert received["t"].device == META and received["n"] == 3
