"""Activation checkpointing's argument (`activation_checkpointing=`, `activation_checkpointing_policy=`
of ddp, fsdp and model_parallel) and its application to a model in one process (under processes:
tests/integration/sharded/test_recompute.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lite_core.errors import ConfigurationError, MisuseError
from lite_core.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lite_core.strategies._recompute import recompute


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.down(torch.relu(self.up(x)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.inner(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.outer = Outer()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.outer(x))


def _step(model: nn.Module) -> dict[str, torch.Tensor]:
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _one_sentence(message: str) -> bool:
    return message.count(". ") == 0 and message.endswith(".")


@pytest.mark.parametrize("policy", [None, [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]])
def test_recomputed_blocks_run_twice_with_the_same_gradients_names_and_keys(policy) -> None:
    torch.manual_seed(0)
    plain = Net()
    model = Net()
    model.load_state_dict(plain.state_dict())
    recompute({Block}, policy).apply(model)
    expected = _step(plain)
    grads = _step(model)
    assert [b.calls for b in model.blocks] == [2, 2]  # forward, and again in backward
    assert model.outer.inner.calls == 2
    assert [b.calls for b in plain.blocks] == [1, 1]
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], atol=1e-6, rtol=0, msg=name)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    Net().load_state_dict(model.state_dict())  # a checkpoint of it loads without recompute


def test_a_block_inside_a_recomputed_block_is_not_checkpointed_again() -> None:
    model = Net()
    recompute({Outer, Block}).apply(model)
    _step(model)
    assert model.outer.inner.calls == 2  # once in forward, once in the outer block's recompute


@pytest.mark.parametrize("strategy", [DDPStrategy, FSDPStrategy, ModelParallelStrategy])
@pytest.mark.parametrize(("blocks", "policy", "start"), [
    ("Block", None, "activation_checkpointing='Block' is not valid"),
    ({int}, None, "activation_checkpointing={<class 'int'>} is not valid"),
    (None, [torch.ops.aten.mm.default], "activation_checkpointing_policy was given without"),
    ({Block}, [torch.ops.aten.mm], "activation_checkpointing_policy=[<OpOverloadPacket(op='aten.mm')>] is not valid"),
])
def test_bad_arguments_are_refused_at_construction_in_one_sentence(strategy, blocks, policy, start) -> None:
    with pytest.raises(ConfigurationError) as info:
        strategy(activation_checkpointing=blocks, activation_checkpointing_policy=policy)
    assert str(info.value).startswith(start) and _one_sentence(str(info.value))


def test_classes_that_match_no_block_are_refused_at_setup() -> None:
    with pytest.raises(MisuseError) as info:
        recompute(nn.GRU).apply(Net())
    assert str(info.value).startswith("activation_checkpointing names GRU, of which Net holds no submodule")
    assert _one_sentence(str(info.value))


def test_a_block_checkpointed_already_is_left_as_it_is() -> None:
    from torch.distributed._composable import checkpoint

    model = Net()
    checkpoint(model.blocks[0])  # the user's own
    recompute({Block}).apply(model)
    recompute({Block}).apply(model)  # a second setup of the same model
    _step(model)
    assert [b.calls for b in model.blocks] == [2, 2]
