"""Checkpoints that travel between DeepSpeed and the other strategies.

`read_whole` reads a ZeRO checkpoint directory (any stage, any number of ranks) in one process
into the content a one-file checkpoint holds: the model as a full fp32 state dict, the optimizer
with its state (fp32 moments such as Adam's `exp_avg`) keyed by parameter name, and the user's
other entries. `load_whole` puts such content into a DeepSpeed engine: the weights into the
model and into the fp32 master copy, the moments into the sharded optimizer state.

Both use DeepSpeed's own tools: `deepspeed.utils.zero_to_fp32` to gather the flat shards (the
moments are laid out exactly like the fp32 master weights, so the same gathering applies), and
the `deepspeed.utils.safe_set_full_*` functions to scatter full tensors into the shards.
DeepSpeed writes its files with pickled objects, so they are read with `weights_only=False`, after
`lite_deepspeed._safe.refuse_code` has checked them with safe loading (unless the user passed
`load(..., weights_only=False)`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch

from lite_core.plugins import CheckpointError, check_weights_fit, shapes_of

#: Key of the client state that records which entries DeepSpeed itself saved (see `_checkpoint`).
LAYOUT_KEY = "lite_deepspeed"


def tag_dir(path: str | Path) -> Path:
    """The folder of the newest save in the DeepSpeed checkpoint directory `path`."""
    latest = Path(path) / "latest"
    if not latest.is_file():
        raise CheckpointError(f"'{path}' holds no DeepSpeed 'latest' file: point load() at a directory written by save().")
    return Path(path) / latest.read_text().strip()


def read_whole(path: str | Path, weights_only: bool = True) -> dict[str, Any]:
    """The whole content of the DeepSpeed checkpoint directory `path`, as a one-file checkpoint
    holds it; with `weights_only`, files that name anything but DeepSpeed's own classes are refused."""
    from deepspeed.utils import zero_to_fp32

    from lite_deepspeed._safe import refuse_code

    folder = tag_dir(path)
    if weights_only:
        refuse_code(folder, str(path))
    model_files = zero_to_fp32.get_model_state_files(str(folder))
    first = torch.load(model_files[0], map_location="cpu", weights_only=False)
    layout = first.get(LAYOUT_KEY)
    if layout is None:
        raise CheckpointError(f"'{path}' is a DeepSpeed checkpoint that Lite did not write: load it with DeepSpeed's own tools.")
    content = {key: first[key] for key in layout["saved"]}
    if first.get("param_shapes") is None:  # ZeRO stage 0: the model and the optimizer are whole
        content[layout["model"]] = first["module"]
        optimizer = first.get("optimizer")
    else:
        with _quiet():  # zero_to_fp32 prints its progress
            content[layout["model"]], optimizer = _gather_zero(folder, model_files)
    if layout.get("trainable") is not None:  # an adapters-only save: its trainable weights, no buffers
        content[layout["model"]] = {name: content[layout["model"]][name] for name in layout["trainable"]}
    for key in layout["optimizers"]:
        content[key] = optimizer
    return content


def trainable_names(folder: Path) -> list[str] | None:
    """The weights an adapters-only save in `folder` holds (`trainable_state(model)`), or None
    for a save of the whole model."""
    from deepspeed.utils import zero_to_fp32

    first = torch.load(zero_to_fp32.get_model_state_files(str(folder))[0], map_location="cpu",
                       weights_only=False, mmap=True)
    return (first.get(LAYOUT_KEY) or {}).get("trainable")


@contextmanager
def _quiet() -> Iterator[None]:
    with open(os.devnull, "w") as sink, redirect_stdout(sink), redirect_stderr(sink):
        yield


def _gather_zero(folder: Path, model_files: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from deepspeed.utils import zero_to_fp32

    model_states = zero_to_fp32.parse_model_states(model_files)
    shards = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
              for f in zero_to_fp32.get_optim_files(str(folder))]
    stage = int(shards[0]["zero_stage"])
    flat_key, inner_key = (("single_partition_of_fp32_groups", "base_optimizer_state") if stage <= 2
                           else ("fp32_flat_groups", "optimizer_state_dict"))
    gather = _gatherer(stage, shards, model_states)
    model = gather([shard[flat_key] for shard in shards])
    inner = [shard[inner_key] for shard in shards]
    sizes = [t.numel() for t in shards[0][flat_key]]
    moments = {key: gather([[state["state"][i][key] for i in range(len(sizes))] for state in inner])
               for key, value in inner[0]["state"].get(0, {}).items()  # none before the first step
               if torch.is_tensor(value) and value.numel() == sizes[0]}
    return model, _optimizer_by_name(inner[0], model_states[0].param_shapes, moments)


def _gatherer(stage: int, shards: list[dict[str, Any]], model_states: list[Any]) -> Any:
    """A function from per-rank flat groups to the full tensors by name (DeepSpeed's gathering)."""
    from deepspeed.utils import zero_to_fp32

    world_size = shards[0]["partition_count"]
    world_size = max(world_size) if isinstance(world_size, list) else int(world_size)
    paddings = shards[0].get("param_alignment_paddings")

    def gather(flat_groups: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        if stage <= 2:
            merged = zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
                world_size, flat_groups, model_states, False, paddings)
        else:
            merged = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world_size, flat_groups, model_states, False)
        return {name: t.detach().clone() for name, t in zero_to_fp32.to_torch_tensor(merged).items()}

    return gather


def _optimizer_by_name(inner: dict[str, Any], param_shapes: list[dict[str, Any]],
                       moments: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, as lite-core restores it into a torch optimizer.

    `inner` is the state dict of the optimizer DeepSpeed steps: each of its parameters is one flat
    group (`param_shapes[i]` names the model parameters in flat group i)."""
    state: dict[str, Any] = {}
    groups = []
    for group in inner["param_groups"]:
        names = []
        for position in group["params"]:
            scalars = {k: v for k, v in inner["state"].get(position, {}).items() if k not in moments}
            for name in param_shapes[position]:
                names.append(name)
                if not scalars and not moments:  # saved before the optimizer's first step
                    continue
                # each parameter its own copy: torch's Adam increments `step` in place
                state[name] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()},
                               **{key: full[name] for key, full in moments.items()}}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def load_whole(engine: Any, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None,
               strict: bool) -> None:
    """Put a full model state (and a name-keyed optimizer state) into `engine` and its optimizer."""
    _check_names(engine, model_state, strict)
    _load_weights(engine, model_state)
    if optimizer_state is not None:
        _load_optimizer(engine, optimizer_state)


def _check_names(engine: Any, model_state: dict[str, torch.Tensor], strict: bool) -> None:
    check_weights_fit(engine.module, whole_shapes(engine.module), shapes_of(model_state), strict)


def whole_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The whole shape of each entry of `module`'s state dict, under ZeRO-3 too (where a
    parameter holds only its partition and `ds_shape` the whole)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {name: tuple(getattr(tensors[name], "ds_shape", tensors[name].shape)) if name in tensors else tuple(value.shape)
            for name, value in module.state_dict().items()}


def saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The whole shapes of the model's weights in the DeepSpeed save in `folder` (its parameters,
    and its buffers at ZeRO stage 0), read from the first model-states file."""
    from deepspeed.utils import zero_to_fp32

    first = torch.load(zero_to_fp32.get_model_state_files(str(folder))[0], map_location="cpu",
                       weights_only=False, mmap=True)
    if first.get("param_shapes") is None:  # ZeRO stage 0: the module's state is whole
        return shapes_of(first["module"])
    return {name: tuple(shape) for group in first["param_shapes"] for name, shape in group.items()}


def _load_weights(engine: Any, model_state: dict[str, torch.Tensor]) -> None:
    import deepspeed

    params = dict(engine.module.named_parameters())
    # whole under ZeRO-3 while copying; rank 0's copy is what every rank keeps
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
        for name, param in params.items():
            if name in model_state:
                param.copy_(model_state[name].reshape(param.shape))
    with torch.no_grad():
        for name, buffer in engine.module.named_buffers():
            if name in model_state:
                buffer.copy_(model_state[name])
    for name, param in params.items():
        if name in model_state and param.requires_grad:
            _set_master(param, model_state[name], None)


def _set_master(param: torch.Tensor, full: torch.Tensor, key: str | None) -> None:
    """Set the fp32 master copy of `param` (`key=None`) or its optimizer state `key` from the full
    tensor `full`, in the shard this rank holds."""
    from deepspeed import utils

    if hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition, padded as DeepSpeed pads it
        local = _partition(param, full.detach().float())
        if key is None:
            utils.safe_set_local_fp32_param(param, local)
        else:
            utils.safe_set_local_optimizer_state(param, local, key)
        return
    value = full.detach().float().reshape(param.shape).to(param.device)
    if key is None:
        utils.safe_set_full_fp32_param(param, value)
    else:
        utils.safe_set_full_optimizer_state(param, value, key)


def _partition(param: Any, full: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    size = param.ds_tensor.numel()
    rank = dist.get_rank(group=getattr(param, "ds_process_group", None))
    flat = full.flatten().to(param.ds_tensor.device)
    padded = torch.nn.functional.pad(flat, (0, max(0, size * (rank + 1) - flat.numel())))
    return padded.narrow(0, size * rank, size)


def _load_optimizer(engine: Any, optimizer_state: dict[str, Any]) -> None:
    if not engine.zero_optimization():  # no ZeRO: the user's torch optimizer holds whole tensors
        from lite_core.plugins import restore

        restore({"model": engine.module, "optimizer": engine.optimizer}, {"model": {}, "optimizer": optimizer_state},
                strict=False, precision=None)  # type: ignore[arg-type]  # no precision entry here
        return
    saved = optimizer_state["state"]
    _create_states(engine, next(iter(saved.values()), {}))
    for name, param in engine.module.named_parameters():
        for key, value in saved.get(name, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:  # a moment: shaped like the parameter
                _set_master(param, value, key)
    _load_scalars_and_groups(engine, optimizer_state)


def _flat_partitions(zero: Any) -> list[torch.Tensor]:
    """The fp32 partitions (one per parameter group) that DeepSpeed's ZeRO optimizer steps."""
    flats = getattr(zero, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    return list(flats if flats is not None else zero.fp32_partitioned_groups_flat)  # ZeRO-3


def _create_states(engine: Any, template: dict[str, Any]) -> None:
    """Give the optimizer DeepSpeed steps the state entries of `template` (a saved parameter's
    state) before its first step, when torch creates them, and link them to the model's
    parameters as DeepSpeed does after loading its own checkpoint, so that full tensors can be
    set into them."""
    zero = engine.optimizer
    for flat in _flat_partitions(zero):
        state = zero.optimizer.state[flat]
        for key, value in template.items():
            if key not in state and torch.is_tensor(value):
                state[key] = torch.zeros_like(flat.detach()) if value.dim() > 0 else value.detach().clone()
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link the states lazily
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _load_scalars_and_groups(engine: Any, optimizer_state: dict[str, Any]) -> None:
    """The per-group values (the learning rate, ...) and the scalar state (Adam's `step`) into the
    optimizer DeepSpeed steps."""
    zero = engine.optimizer
    for group, saved in zip(zero.optimizer.param_groups, optimizer_state["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    first = next(iter(optimizer_state["state"].values()), {})
    scalars = {k: v for k, v in first.items() if not torch.is_tensor(v) or v.dim() == 0}
    for flat in _flat_partitions(zero):
        for key, value in scalars.items():
            zero.optimizer.state[flat][key] = value.clone() if torch.is_tensor(value) else value
