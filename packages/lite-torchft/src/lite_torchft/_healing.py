"""What a healing replica group receives from a peer: every set-up model, optimizer and loader,
and what Lite handed the strategy to carry along (`Strategy.carry_in_heals`)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from lite_torchft._stream import LoaderStream


class HealingState:
    """The objects Lite set up in this group, in set-up order, and their state as one dict.

    Loaders take part from their first pass on; a peer's loader state that arrives before this
    group iterated that loader waits here and is applied at the loader's first pass.
    """

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []
        self.optimizers: list[Optimizer] = []
        self.streams: list[LoaderStream] = []
        self._waiting_loaders: list[dict[str, Any]] = []
        self._waiting_resumed = False  # whether those positions came from a checkpoint
        self.carried: dict[str, Any] = {}  # name -> an object with state_dict/load_state_dict (carry_in_heals)
        self.heals = 0  # the peer states this group took over (torchft's first sync of a new group too)

    def add_stream(self, stream: LoaderStream) -> None:
        """Register a loader at its first pass (it resumes a peer's position received earlier)."""
        index = len(self.streams)
        self.streams.append(stream)
        if index < len(self._waiting_loaders):
            stream.load_state_dict(self._waiting_loaders[index], resumed=self._waiting_resumed)

    def state_dict(self) -> dict[str, Any]:
        """What a peer needs to continue from here."""
        return {
            "modules": [module.state_dict() for module in self.modules],
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "loaders": [stream.state_dict() for stream in self.streams] + self._waiting_loaders[len(self.streams):],
            "carried": {name: carried.state_dict() for name, carried in self.carried.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a peer's state (models and optimizers in place, loader positions)."""
        self.heals += 1
        for module, module_state in zip(self.modules, state["modules"], strict=True):
            module.load_state_dict(module_state)
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        self.load_positions(state["loaders"])
        for name, carried_state in state.get("carried", {}).items():  # a peer without one sends none
            if name in self.carried:
                self.carried[name].load_state_dict(carried_state)

    def load_positions(self, positions: list[dict[str, Any]], resumed: bool = False) -> None:
        """Move every loader to its position (a loader not iterated yet takes it at its first pass);
        `resumed`: the positions come from a checkpoint, not from a peer (see `LoaderStream`)."""
        for stream, position in zip(self.streams, positions):
            stream.load_state_dict(position, resumed=resumed)
        self._waiting_loaders, self._waiting_resumed = list(positions), resumed
