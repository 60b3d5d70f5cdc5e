"""`strategy="xla_fsdp"`: parameters, gradients and optimizer state sharded over XLA devices."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core.plugins import (
    CheckpointIO,
    MisuseError,
    Precision,
    TrainableState,
    check_weights_fit,
    forward_module,
    on_writing_ranks,
    restore,
    to_state,
)
from lite_xla._sharded_checkpoint import user_name
from lite_xla.strategies import _device
from lite_xla.strategies.xla import XLAStrategy


class XLAFSDPStrategy(XLAStrategy):
    """Wraps the model in torch-xla's `XlaFullyShardedDataParallel` across the replicas.

    Sharding replaces the model's parameters, so optimizers given to `setup(model, optimizer)`
    are pointed, in place, at the shards of their parameters: each parameter group keeps its own
    hyperparameters, state already held (e.g. momentum) is sharded the same way, and a
    learning-rate scheduler built on the optimizer keeps working. An optimizer made before
    `setup_module()` and set up on its own is refused. `clip_gradients(max_norm=...)` clips by
    the norm of the whole model's gradients, summed over the shards of every replica.

    Args:
        pin_layout: passed to torch-xla's collectives as `pin_layout_in_collective_ops`.
        start_method: how torch-xla starts the replica processes.
        **fsdp_kwargs: passed on to `XlaFullyShardedDataParallel`.
    """

    name = "xla_fsdp"
    routes_named_parameters: ClassVar[bool] = True  # `module_named_parameters` yields the shards
    stages_checkpoints: ClassVar[bool] = False  # `save_checkpoint` writes shards, with no staging
    routes_load_state_dict: ClassVar[bool] = True  # `load_module_state_dict` cuts whole weights into the shards

    def __init__(self, pin_layout: bool = True, start_method: str = "spawn", **fsdp_kwargs: Any) -> None:
        super().__init__(pin_layout=pin_layout, start_method=start_method)
        self._fsdp_kwargs = fsdp_kwargs
        self._sharded: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_sharded"] = set()
        return state

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        module = super().setup_module(module, precision=precision)  # every replica starts from rank 0's weights
        kwargs = {"pin_layout_in_collective_ops": self.pin_layout, **self._fsdp_kwargs}
        sharded = XlaFullyShardedDataParallel(module, **kwargs)
        self._sharded.update(id(p) for p in sharded.parameters())
        return sharded

    def module_named_parameters(self, module: nn.Module, forward_module: nn.Module, prefix: str = "",
                                recurse: bool = True, remove_duplicate: bool = True
                                ) -> Iterator[tuple[str, nn.Parameter]]:
        """The shards that train, under the names the module gives their parameters: torch-xla's
        FSDP takes the module's own parameters out of it and registers a flat shard of each on its
        wrapper, so an optimizer made from `model.parameters()` after `setup_module()` holds them."""
        for name, shard in forward_module.named_parameters(remove_duplicate=remove_duplicate):
            name = user_name(name)
            if recurse or "." not in name:
                yield (f"{prefix}.{name}" if prefix else name), shard

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], *,
                                    precision: Precision) -> tuple[nn.Module, list[Optimizer]]:
        sharded = self.setup_module(module, precision=precision)
        for optimizer in optimizers:
            _point_at_shards(optimizer, sharded, self._on_device)
        return sharded, optimizers

    def _on_device(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter that replaced `param` when the model moved to the device (or itself)."""
        return self._moved[id(param)][1] if id(param) in self._moved else param

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

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True, *,
                            precision: Precision) -> torch.Tensor:
        """Clip by the norm of all gradients, every replica's shard included (torch-xla's
        `clip_grad_norm_` of the sharded model); returns that norm, the same on every replica."""
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        precision.unscale_gradients(optimizer)
        sharded = forward_module(module)
        if not isinstance(sharded, XlaFullyShardedDataParallel):
            raise MisuseError(
                "clip_gradients() under strategy='xla_fsdp' needs the model that setup() returned:"
                " pass that model, not the original one."
            )
        norm = sharded.clip_grad_norm_(max_norm, norm_type)
        self._check_finite(norm, norm_type, error_if_nonfinite, precision)
        return norm

    # -- whole state: gathered to rank 0, loaded from whole tensors --------------------------------
    def full_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Every replica's shards joined on rank 0 with torch-xla's `consolidate_sharded_state_dicts`
        (plain CPU tensors under the module's own names; an empty dict on the other replicas).
        Every replica calls it: each sends its shards to rank 0."""
        from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

        from lite_xla import _sharded_checkpoint as sharded

        entry = sharded.sharded_entry(module)
        if entry is None:
            return super().full_module_state_dict(module)
        local = _device.to_cpu(entry["state_dict"])
        states = [self.broadcast(local, src=rank) for rank in range(self.world_size)]
        if self.global_rank != 0:
            return {}
        whole = consolidate_sharded_state_dicts(states, entry["shard_metadata"])
        return {name: value.detach().clone() for name, value in whole.items()}

    def full_trainable_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """What `full_module_state_dict` gives, for the parameters that train (their shards' flag)."""
        names = [name for name, shard in self.module_named_parameters(module, forward_module(module))
                 if shard.requires_grad]
        whole = self.full_module_state_dict(module)
        return {name: whole[name] for name in names if name in whole}

    def load_module_state_dict(self, module: nn.Module, state_dict: Any, strict: bool = True,
                               assign: bool = False) -> Any:
        """Whole tensors (a `full_state_dict`, an adapters-only checkpoint) cut into this replica's
        shards as torch-xla's FSDP cut the parameters; with `strict`, every parameter must be there."""
        shards = dict(self.module_named_parameters(module, forward_module(module)))
        missing = [name for name in shards if name not in state_dict]
        unexpected = [name for name in state_dict if name not in shards]
        if strict and (missing or unexpected):
            raise MisuseError(f"load_state_dict under strategy='xla_fsdp' got keys that differ from the model's"
                              f" (missing {missing[:3]}, unexpected {unexpected[:3]}): pass every weight under"
                              " the model's own names, or strict=False.")
        with torch.no_grad():
            for name, value in state_dict.items():
                if name in shards:
                    shards[name].copy_(_cut(value, shards[name]))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # -- checkpoints: `path` is a folder with one shard file per replica ------------------------
    def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> None:
        """Every replica writes its shard to `path/shard-RANK-of-WORLD.pt`; models are saved as
        their sharded state and metadata (join them with `lite_xla.consolidate_checkpoint`). If a
        write fails, every replica raises."""
        from lite_xla import _sharded_checkpoint as sharded

        entries = {key: sharded.sharded_entry(value) if isinstance(value, nn.Module) else None
                   for key, value in content.items()}
        plain = {key: value for key, value in content.items() if entries[key] is None}
        plain_state = to_state(plain, precision)
        for key in [k for k, value in plain.items() if isinstance(value, TrainableState)]:
            # gathered whole on rank 0; every replica's file holds it, as each replica loads its own file
            plain_state[key] = self.broadcast(_device.to_cpu(plain_state[key]), src=0)
        state = _device.to_cpu({**plain_state, **{k: v for k, v in entries.items() if v is not None}})

        def write() -> None:
            Path(path).mkdir(parents=True, exist_ok=True)
            checkpoint_io.save(state, str(sharded.shard_file(path, self.global_rank, self.world_size)))

        on_writing_ranks(self, path, write, writes=True)

    def load_checkpoint(self, path: str, state: dict[str, Any] | None = None, strict: bool = True,
                        weights_only: bool = True, *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> dict[str, Any]:
        """Read this replica's shard from the folder `path` and restore `state` from it."""
        from lite_xla import _sharded_checkpoint as sharded

        shard = sharded.shard_file(path, self.global_rank, self.world_size)
        content = checkpoint_io.load(str(shard), weights_only=weights_only)
        if state is None:
            return content
        modules = {k for k, v in content.items() if isinstance(v, dict) and v.get(sharded.MARK)}
        for key in modules & state.keys():
            target = forward_module(state[key])
            check_weights_fit(state[key], sharded.whole_shapes(target.get_shard_metadata()),
                              sharded.whole_shapes(content[key]["shard_metadata"]), strict)
            target.load_state_dict(content[key]["state_dict"], strict=strict)
        rest = {k: v for k, v in state.items() if k not in modules}
        restore(rest, {k: v for k, v in content.items() if k not in modules}, strict=strict, precision=precision)
        state.update(rest)
        return content



def _point_at_shards(optimizer: Optimizer, sharded: nn.Module, on_device: Any) -> None:
    """Replace the full parameters in `optimizer` (its groups and its state) by their shards, in
    place, so that the object, its groups' hyperparameters and a scheduler on it carry over."""
    shards = {id(p): _shard_of(on_device(p)) for group in optimizer.param_groups for p in group["params"]}
    if None in shards.values():  # torch-xla's flatten_parameters=True joins parameters into one shard
        _point_flattened(optimizer, sharded)
        return
    for group in optimizer.param_groups:
        group["params"] = [shards[id(p)] for p in group["params"]]
    for param in [p for p in optimizer.state if id(p) in shards]:
        shard = shards[id(param)]
        optimizer.state[shard] = {key: _shard_like(value, param, shard)
                                  for key, value in optimizer.state.pop(param).items()}


def _shard_of(param: torch.Tensor) -> torch.Tensor | None:
    """The shard torch-xla's FSDP made of `param` (it keeps it on the full parameter)."""
    return getattr(param, "_sharded_param", None)


def _shard_like(value: Any, param: torch.Tensor, shard: torch.Tensor) -> Any:
    """This replica's part of a per-parameter state tensor, cut as FSDP cut `param`: flattened,
    padded to a multiple of the replica count, and split evenly (scalars such as `step` stay)."""
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    return _cut(value, shard).clone()


def _cut(value: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """This replica's part of the whole tensor `value`, cut as FSDP cuts a parameter: flattened,
    padded to a multiple of the replica count, and split evenly."""
    import torch_xla.runtime as xr

    size = shard.numel()
    flat = torch.nn.functional.pad(value.detach().flatten(), (0, size * xr.world_size() - value.numel()))
    start = size * xr.global_ordinal()
    return flat[start:start + size].to(shard.device, shard.dtype).reshape(shard.shape)


def _point_flattened(optimizer: Optimizer, sharded: nn.Module) -> None:
    if len(optimizer.param_groups) != 1 or optimizer.state:
        raise MisuseError(
            "strategy='xla_fsdp' with flatten_parameters=True joins the parameters into one shard, so"
            " this optimizer's parameter groups or state cannot follow them: leave flatten_parameters"
            " at torch-xla's default (False), or create the optimizer from the model that"
            " setup_module() returned."
        )
    optimizer.param_groups[0]["params"] = list(sharded.parameters())
