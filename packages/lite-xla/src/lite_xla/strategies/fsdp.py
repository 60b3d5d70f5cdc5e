"""`strategy="xla_fsdp"`: parameters, gradients and optimizer state sharded over XLA devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lite_core.plugins import MisuseError, restore, to_state
from lite_xla.strategies import _device
from lite_xla.strategies.xla import XLAStrategy


class XLAFSDPStrategy(XLAStrategy):
    """Wraps the model in torch-xla's `XlaFullyShardedDataParallel` across the replicas.

    Sharding replaces the model's parameters, so optimizers given to `setup(model, optimizer)`
    are rebuilt on the sharded parameters (same class and hyperparameters); an optimizer made
    before `setup_module()` and set up on its own is refused.

    Args:
        pin_layout: passed to torch-xla's collectives as `pin_layout_in_collective_ops`.
        start_method: how torch-xla starts the replica processes.
        **fsdp_kwargs: passed on to `XlaFullyShardedDataParallel`.
    """

    name = "xla_fsdp"

    def __init__(self, pin_layout: bool = True, start_method: str = "spawn", **fsdp_kwargs: Any) -> None:
        super().__init__(pin_layout=pin_layout, start_method=start_method)
        self._fsdp_kwargs = fsdp_kwargs
        self._sharded: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_sharded"] = set()
        return state

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        module = super().setup_module(module)  # every replica starts from rank 0's weights
        kwargs = {"pin_layout_in_collective_ops": self.pin_layout, **self._fsdp_kwargs}
        sharded = XlaFullyShardedDataParallel(module, **kwargs)
        self._sharded.update(id(p) for p in sharded.parameters())
        return sharded

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer]
                                    ) -> tuple[nn.Module, list[Optimizer]]:
        sharded = self.setup_module(module)
        return sharded, [_rebuild(optimizer, sharded) for optimizer in optimizers]

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not all(id(p) in self._sharded for p in params):
            raise MisuseError(
                "strategy='xla_fsdp' shards the model's parameters, and this optimizer holds the"
                " unsharded ones: pass it to setup(model, optimizer), or create it from the model"
                " that setup_module() returned."
            )
        return optimizer

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Nothing to do: the sharded model reduce-scatters the gradients in backward."""

    # -- checkpoints: `path` is a folder with one shard file per replica ------------------------
    def save_checkpoint(self, path: str, content: dict[str, Any]) -> None:
        """Every replica writes its shard to `path/shard-RANK-of-WORLD.pt`; models are saved as
        their sharded state and metadata (join them with `lite_xla.consolidate_checkpoint`)."""
        from lite_xla import _sharded_checkpoint as sharded

        entries = {key: sharded.sharded_entry(value) if isinstance(value, nn.Module) else None
                   for key, value in content.items()}
        plain = {key: value for key, value in content.items() if entries[key] is None}
        state = _device.to_cpu({**to_state(plain, self), **{k: v for k, v in entries.items() if v is not None}})
        Path(path).mkdir(parents=True, exist_ok=True)
        self.checkpoint_io.save(state, str(sharded.shard_file(path, self.global_rank, self.world_size)))
        self.barrier("save_checkpoint")

    def load_checkpoint(self, path: str, state: dict[str, Any] | None = None, strict: bool = True,
                        weights_only: bool = True) -> dict[str, Any]:
        """Read this replica's shard from the folder `path` and restore `state` from it."""
        from lite_xla import _sharded_checkpoint as sharded

        shard = sharded.shard_file(path, self.global_rank, self.world_size)
        content = self.checkpoint_io.load(str(shard), weights_only=weights_only)
        if state is None:
            return content
        modules = {k for k, v in content.items() if isinstance(v, dict) and v.get(sharded.MARK)}
        for key in modules & state.keys():
            target = getattr(state[key], "_forward_module", state[key])
            target.load_state_dict(content[key]["state_dict"], strict=strict)
        rest = {k: v for k, v in state.items() if k not in modules}
        restore(rest, {k: v for k, v in content.items() if k not in modules}, strict=strict, strategy=self)
        state.update(rest)
        return content


def _rebuild(optimizer: Optimizer, sharded: nn.Module) -> Optimizer:
    if len(optimizer.param_groups) != 1 or optimizer.state:
        raise MisuseError(
            "strategy='xla_fsdp' can rebuild only a fresh optimizer with one parameter group on the"
            " sharded model: create the optimizer from the model that setup_module() returned and"
            " pass it to setup_optimizers()."
        )
    return type(optimizer)(sharded.parameters(), **optimizer.defaults)
