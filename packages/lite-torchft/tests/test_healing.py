"""What a healing group takes from its peer besides the model: the objects Lite hands the strategy
with `carry_in_heals` (the tracker loggers' kept values), by name."""

from __future__ import annotations

from typing import Any

from lite_torchft._healing import HealingState


class _Kept:
    def __init__(self, values: dict[int, float]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return {"values": dict(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.update(state["values"])


def test_a_heal_carries_what_lite_handed_the_strategy_by_name() -> None:
    source, healed = HealingState(), HealingState()
    source.carried["loggers"], healed.carried["loggers"] = _Kept({17: 1.7, 18: 1.8}), _Kept({})
    healed.load_state_dict(source.state_dict())
    assert healed.carried["loggers"].values == {17: 1.7, 18: 1.8} and healed.heals == 1


def test_a_peer_that_carries_nothing_heals_the_model_alone() -> None:
    """A peer of an older lite-torchft sends no `"carried"`; a name this group does not carry is ignored."""
    healed = HealingState()
    healed.carried["loggers"] = _Kept({5: 0.5})
    healed.load_state_dict({"modules": [], "optimizers": [], "loaders": []})
    healed.load_state_dict({"modules": [], "optimizers": [], "loaders": [], "carried": {"other": {"values": {}}}})
    assert healed.carried["loggers"].values == {5: 0.5} and healed.heals == 2
