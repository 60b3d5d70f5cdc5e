"""A fault-tolerance algorithm written on `lite_torchft.Algorithm` (docs/backends/torchft.md's example)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim import Optimizer

from lite_torchft import Algorithm


class PullToAverage(Algorithm):
    """Every `sync_every` inner steps, each replica group moves its weights `pull` of the way to
    the average of the groups' weights (`pull=1` is Local SGD; `pull=0` never meets)."""

    def __init__(self, sync_every: int, pull: float = 0.5) -> None:
        super().__init__(sync_every)
        self.pull = pull
        self.inner_steps = 0  # since the last sync

    def build(self, manager: Any, model: nn.Module, optimizer: Optimizer) -> contextlib.AbstractContextManager[None]:
        self.manager, self.parameters = manager, list(model.parameters())
        return self._hooks_on(optimizer)

    @contextlib.contextmanager
    def _hooks_on(self, optimizer: Optimizer) -> Iterator[None]:
        # a peer that heals from this group reads its weights: not while the optimizer changes them
        before = optimizer.register_step_pre_hook(lambda *_: self.manager.disallow_state_dict_read())
        after = optimizer.register_step_post_hook(lambda *_: self.after_step())
        try:
            yield
        finally:
            before.remove()
            after.remove()

    def after_step(self) -> None:
        self.manager.allow_state_dict_read()
        self.inner_steps += 1
        if self.inner_steps < self.sync_every:
            return
        self.inner_steps = 0
        self.manager.start_quorum()  # a group that starts again heals here from a peer
        averages = [parameter.detach().clone() for parameter in self.parameters]
        for work in [self.manager.allreduce(average) for average in averages]:  # the mean over the quorum
            work.wait()
        if self.manager.should_commit():  # every group in the quorum got the same averages
            with torch.no_grad():
                for parameter, average in zip(self.parameters, averages):
                    parameter.lerp_(average, self.pull)

    def state_dict(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner_steps = int(state["inner_steps"])
