"""The protocols of `lite_core._roles` name members that every strategy has, and nothing open-ended."""

from __future__ import annotations

import inspect

import pytest

from lite_core import LightningLite, _roles

_PROTOCOLS = [obj for _, obj in inspect.getmembers(_roles, inspect.isclass) if obj.__module__ == _roles.__name__]


def _members(protocol: type) -> set[str]:
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls.__module__ == _roles.__name__:
            names |= {name for name in vars(cls) if not name.startswith("_")}
    return names


def test_no_protocol_accepts_any_attribute() -> None:
    for protocol in _PROTOCOLS:
        assert "__getattr__" not in vars(protocol), protocol.__name__
        assert _members(protocol), protocol.__name__


@pytest.mark.parametrize("strategy", ["single_device", "ddp", "ddp_spawn", "fsdp"])
def test_every_connected_strategy_is_each_protocol(strategy: str) -> None:
    connected = LightningLite(accelerator="cpu", strategy=strategy, devices=2 if strategy != "single_device" else 1).strategy
    for protocol in _PROTOCOLS:
        missing = sorted(name for name in _members(protocol) if not hasattr(connected, name))
        if protocol is _roles.ShardsCheckpoints and strategy != "fsdp":
            continue  # only the sharding strategies hand themselves to that code
        assert not missing, f"{type(connected).__name__} lacks {missing} of {protocol.__name__}"


def test_no_protocol_reads_a_precision_from_the_strategy() -> None:
    # The job's precision is the plan's: the rooms hand it to the strategy's hooks beside it.
    for protocol in _PROTOCOLS:
        assert "precision" not in _members(protocol), protocol.__name__
