"""An adapters-only checkpoint entry: the parameters of a set-up model that train."""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from lite_core.checkpoint._state import check_module_keys, check_module_shapes, shapes_of


class _SpreadsModules(Protocol):
    """What `TrainableState` reads of the strategy that set the model up."""

    def full_trainable_state_dict(self, module: nn.Module) -> dict[str, Any]: ...

    def load_module_state_dict(self, module: nn.Module, state_dict: Any, strict: bool = True,
                               assign: bool = False) -> Any: ...


class TrainableState:
    """The parameters of a set-up model that train, as one entry of `LightningLite.save` and
    `load`'s content: LoRA adapters without their frozen base (see `LightningLite.trainable_state`).

    Saved as a plain state dict of whole tensors under the model's own names, gathered to rank 0
    under every strategy (only these parameters are gathered where the strategy shards); loaded
    into the set-up model under any strategy, each process keeping its shard. A strategy with a
    checkpoint format of its own (DeepSpeed's) finds the model in `module` and writes only these
    parameters in that format.
    """

    def __init__(self, strategy: _SpreadsModules, module: nn.Module) -> None:
        self._strategy = strategy
        self._module = module

    @property
    def module(self) -> nn.Module:
        """The set-up model whose trainable parameters this entry stands for."""
        return self._module

    def names(self) -> list[str]:
        """The state-dict names of the model's parameters that train, in its order (as the set-up
        model names them: where a strategy took them out of the module, its shards' names)."""
        return [name for name, parameter in self._module.named_parameters() if parameter.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        """The trainable parameters, whole, on rank 0 (an empty dict on the others); every rank calls it."""
        return self._strategy.full_trainable_state_dict(self._module)

    def check_names(self, saved: list[str]) -> None:
        """Raise a `CheckpointError` unless `saved` names exactly the model's trainable parameters."""
        check_module_keys(self._module, self.names(), saved)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load saved trainable parameters into the model; the other weights stay as they are.

        Raises:
            CheckpointError: (`strict`) `state_dict` names a weight that does not train in this
                model, or lacks one that does; a weight has another shape than the model's.
        """
        names = self.names()
        if strict:
            self.check_names(list(state_dict))
        trained = {name: state_dict[name] for name in names if name in state_dict}
        check_module_shapes(self._module, shapes_of(self._module.state_dict(keep_vars=True)), shapes_of(trained))
        self._strategy.load_module_state_dict(self._module, trained, strict=False)
