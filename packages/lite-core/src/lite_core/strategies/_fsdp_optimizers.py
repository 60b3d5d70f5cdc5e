"""Moving an optimizer created before `fsdp` sharded its model onto the sharded parameters.

`fully_shard` replaces each parameter of the module with a new, sharded one, so an optimizer
built before setup would hold parameters that no longer train anything. Rather than building a
second optimizer, the user's own object is re-pointed in place: each param group's list gets the
sharded parameters in the same order (so anything that kept a reference to the list, such as
`LBFGS`, sees them too) and the state moves with them. The object, its class, its groups'
hyperparameters and every LR scheduler built on it stay the same.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lite_core.checkpoint._state import positions_to_names


class OptimizerMove:
    """An optimizer's parameters by name, captured before sharding, and its state keyed by name."""

    def __init__(self, optimizer: Optimizer, names: list[list[str]], state: dict[str, Any] | None) -> None:
        self.optimizer = optimizer
        self.names = names
        self.state = state

    def onto(self, module: nn.Module) -> None:
        """Give the optimizer `module`'s (now sharded) parameters and shard its state like them."""
        parameters = dict(module.named_parameters())
        for group, names in zip(self.optimizer.param_groups, self.names):
            group["params"][:] = [parameters[name] for name in names]
        self.optimizer.state = defaultdict(dict)
        if self.state is None:
            return
        hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        _load_full_state(module, self.optimizer, self.state)
        for group, own in zip(self.optimizer.param_groups, hyperparameters):
            group.update(own)  # exactly the user's values (loading turns tuples such as `betas` into lists)


def capture(optimizer: Optimizer, module: nn.Module) -> OptimizerMove:
    """Record, before `module` is sharded, which of its parameters `optimizer` holds, and its state."""
    names = {id(p): name for name, p in module.named_parameters()}
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    state = positions_to_names(optimizer.state_dict(), optimizer, module) if optimizer.state else None
    return OptimizerMove(optimizer, groups, state)


class NamesBeforeSharding:
    """The names of a module's parameters before `fully_shard` replaced them, by identity, so that
    an optimizer built before setup and set up later (`setup_optimizers`) can be re-pointed too."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._names = {id(p): (weakref.ref(p), name) for name, p in module.named_parameters()}

    def move(self, optimizer: Optimizer) -> OptimizerMove | None:
        """The move onto the shards of an optimizer that holds only this module's parameters as
        they were before sharding, with no state yet; `None` for any other optimizer."""
        groups = [[self._name_of(p) for p in group["params"]] for group in optimizer.param_groups]
        if optimizer.state or any(name is None for names in groups for name in names):
            return None
        return OptimizerMove(optimizer, groups, None)  # type: ignore[arg-type]

    def _name_of(self, parameter: Any) -> str | None:
        ref, name = self._names.get(id(parameter), (None, None))
        return name if ref is not None and ref() is parameter else None


def _load_full_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(module, optimizer, state, options=options)
