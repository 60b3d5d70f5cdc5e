"""Saving and loading under `fsdp`: sharded directories (torch distributed checkpoint) or one
full file, both read back at any process count. The formats are described in `lite_core.checkpoint`."""

from __future__ import annotations

import inspect
import time
import weakref
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lite_core.checkpoint._background import Write, checkpoint_process_group, nothing, stage_to_host
from lite_core.checkpoint._plain import plain_tensors
from lite_core.checkpoint._sharded import (
    EXTRA_FILE,
    is_sharded,
    read_sharded,
    reading_metadata_once,
    storage_reader,
)
from lite_core.checkpoint._rank_zero import _describe, first_failure, on_rank_zero, shard_failure
from lite_core.checkpoint._state import (
    PRECISION_KEY,
    check_module_keys,
    check_module_shapes,
    is_keyed_by_name,
    positions_to_names,
    read_checkpoint,
    restore,
    shapes_of,
    state_of,
)
from lite_core.checkpoint.stores import Store, store_for
from lite_core._user_frame import warn_user
from lite_core.errors import CheckpointError
from lite_core.model.optimizer import unwrap_optimizer
from lite_core.model.parts import forward_module

if TYPE_CHECKING:
    from lite_core._roles import ShardsCheckpoints
    from lite_core.checkpoint._io import CheckpointIO
    from lite_core.precision.precision import Precision


def _unwrap(value: Any) -> Any:
    return unwrap_optimizer(value) if isinstance(value, Optimizer) else forward_module(value)


def _split(content: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the modules and optimizers, unwrapped; every other value)."""
    objects = {k: _unwrap(v) for k, v in content.items() if isinstance(v, (nn.Module, Optimizer))}
    return objects, {k: v for k, v in content.items() if k not in objects}


def _holds(value: Any, kind: type) -> bool:
    """Whether `value` is a `kind` (a `DTensor`, a `Tensor`) or a dict or list that holds one, at
    any depth. A value of the user's own that holds a `DTensor` is sharded like the model (an
    average of its parameters): only torch distributed checkpoint writes and reads it whole."""
    if isinstance(value, kind):
        return True
    if isinstance(value, dict):
        return any(_holds(each, kind) for each in value.values())
    if isinstance(value, list):
        return any(_holds(each, kind) for each in value)
    return False


def _options(full: bool, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full, strict=strict)


def _state_of(strategy: ShardsCheckpoints, obj: Any, full: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if isinstance(obj, Optimizer):
        unstepped = not obj.state
        state = get_optimizer_state_dict(strategy.module_of(obj), obj, options=_options(full))
        if unstepped:  # torch made the state with a step of zero gradients and lr 0; that step
            obj.state.clear()  # must not count in the training that follows (Adam's bias correction)
            state = {**state, "state": {}}  # as `Optimizer.state_dict()` before the first step
        return plain_tensors(_whole_model_groups(strategy, obj, state))
    return plain_tensors(get_model_state_dict(obj, options=_options(full)))


def _whole_model_groups(strategy: ShardsCheckpoints, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """Under a pipeline, each param group names the whole model's parameters, as on every stage:
    torch distributed checkpoint keeps one copy of each group's entries (`param_groups.0.params`
    is not a tensor), so stages that named only their own would load another stage's names."""
    names = strategy.parameter_names_before_split(optimizer)
    if names is None:
        return state
    groups = [{**group, "params": list(whole)} for group, whole in zip(state["param_groups"], names)]
    return {**state, "param_groups": groups}


def _load_into(strategy: ShardsCheckpoints, obj: Any, value: Any, full: bool, strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if isinstance(obj, Optimizer):
        module = strategy.module_of(obj)
        if not is_keyed_by_name(value):  # a plain `Optimizer.state_dict()` saved by another strategy
            value = positions_to_names(value, obj, module)
        full = full and _has_tensors_to_shard(value)
        set_optimizer_state_dict(module, obj, value, options=_options(full))
        if not value.get("state"):  # saved before the first step: torch's own zero step must not count
            obj.state.clear()
    else:
        if full and isinstance(value, dict):  # torch's full load names only the unexpected keys, or shapes in a list
            own = obj.state_dict(keep_vars=True)
            if strict:
                check_module_keys(obj, own, value)
            check_module_shapes(obj, shapes_of(own), shapes_of(value))
        set_model_state_dict(obj, value, options=_options(full, strict))


def _has_tensors_to_shard(optimizer_state: dict[str, Any]) -> bool:
    """Whether a full optimizer state holds per-parameter tensors (not just scalars) to cut into shards.

    Torch's full load takes the device of the shards from such tensors in the live optimizer's
    state and fails ("Expected device to be set") where it has none: SGD without momentum, stepped
    or not. Where the saved state has none (that optimizer, or any saved before its first step)
    there is nothing to shard: the param groups (and any scalars) load as they are on every rank.
    """
    return any(isinstance(value, Tensor) and value.dim() > 0
               for per_parameter in optimizer_state.get("state", {}).values() for value in per_parameter.values())


def _gathered(plain: dict[str, Any]) -> dict[str, Any]:
    """The values with each `DTensor` they hold gathered whole into host memory (as the model's
    weights are in a full checkpoint), so that the one file holds plain tensors; every rank takes
    part in the gathering."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    return {key: tree_map_only(DTensor, lambda tensor: tensor.full_tensor().cpu(), value) if _holds(value, DTensor)
            else value for key, value in plain.items()}


def _extra(precision: Precision, plain: dict[str, Any]) -> dict[str, Any]:
    """The values saved besides modules and optimizers: stateful objects (an LR scheduler, a
    scaler) as their `state_dict()`, plus the state of `precision` (the job's)."""
    extra = {key: state_of(value) for key, value in plain.items()}
    precision_state = precision.state_dict()
    return {**extra, PRECISION_KEY: precision_state} if precision_state else extra


# -- save ---------------------------------------------------------------------------------------
def save_full(strategy: ShardsCheckpoints, path: str, content: dict[str, Any], checkpoint_io: CheckpointIO,
              precision: Precision) -> None:
    """Gather everything to rank 0 and write one file there with `checkpoint_io` (with
    `precision`'s state)."""
    objects, plain = _split(content)
    state = {key: _state_of(strategy, obj, full=True) for key, obj in objects.items()}
    extra = _extra(precision, _gathered(plain))
    on_rank_zero(strategy, path, lambda: checkpoint_io.save({**state, **extra}, path))


def stage_full(strategy: ShardsCheckpoints, path: str, content: dict[str, Any], checkpoint_io: CheckpointIO,
               precision: Precision) -> Write:
    """`save_full` in the background: gather to rank 0 and copy there now, write in the thread."""
    objects, plain = _split(content)
    state = stage_to_host({key: _state_of(strategy, obj, full=True) for key, obj in objects.items()})
    extra = stage_to_host(_extra(precision, _gathered(plain)))
    if strategy.global_rank != 0:
        return nothing
    return lambda: checkpoint_io.save({**state, **extra}, path)


def save_sharded(strategy: ShardsCheckpoints, path: str, content: dict[str, Any],
                 checkpoint_io: CheckpointIO, precision: Precision) -> None:
    """Every process writes its shards into a fresh directory that then replaces `path`, so a
    crash while writing leaves the previous checkpoint intact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    started = time.time()
    store = store_for(path)
    state, extra, folder = _prepare_sharded(strategy, store, path, content, checkpoint_io, precision)
    try:
        dcp.save(state, storage_writer=store.shard_writer(folder))
    except CheckpointException as err:  # raised on every rank; a BaseException
        raise shard_failure(path, err) from None
    on_rank_zero(strategy, path, lambda: store.commit_sharded(folder, path, extra, checkpoint_io, started))


def stage_sharded(strategy: ShardsCheckpoints, path: str, content: dict[str, Any],
                  checkpoint_io: CheckpointIO, precision: Precision) -> Write:
    """`save_sharded` in the background: torch distributed checkpoint's `async_save` copies the
    shards to host memory and writes them in its thread, over a process group of its own; when
    they are written (on every rank), rank 0 puts the directory in place as `save_sharded` does.

    A strategy whose checkpoints are sharded this way (any module that `_state_of` reads with
    torch's `get_model_state_dict`) returns this from its `stage_checkpoint`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    started = time.time()
    store = store_for(path)
    state, extra, folder = _prepare_sharded(strategy, store, path, content, checkpoint_io, precision)
    extra = stage_to_host(extra)
    written = dcp.async_save(state, storage_writer=store.shard_writer(folder), process_group=checkpoint_process_group())

    def write() -> None:
        try:
            written.result()
        except CheckpointException as err:  # a BaseException: the writer thread would not report it
            raise shard_failure(path, err) from None
        if strategy.global_rank == 0:
            store.commit_sharded(folder, path, extra, checkpoint_io, started)

    return write


def _prepare_sharded(strategy: Any, store: Store, path: str, content: dict[str, Any],
                     checkpoint_io: CheckpointIO, precision: Precision) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(the sharded state of the modules, the optimizers and the values that hold `DTensor`s, the
    other values, the folder every rank writes its shards into: `store.start_sharded`'s, on rank 0)."""
    from torch.distributed.tensor import DTensor

    _warn_of_a_file_name(strategy, path)
    objects, plain = _split(content)
    state = {key: _state_of(strategy, obj, full=False) for key, obj in objects.items()}
    state.update({key: value for key, value in plain.items() if _holds(value, DTensor)})
    extra = _extra(precision, {key: value for key, value in plain.items() if key not in state})
    folder = on_rank_zero(strategy, path, lambda: store.start_sharded(path, extra, checkpoint_io))
    return state, extra, folder


#: The suffixes of a one-file checkpoint's name: a sharded save to such a name says it writes a folder.
FILE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
_warned_of_file_names: weakref.WeakSet[Any] = weakref.WeakSet()


def _warn_of_a_file_name(strategy: Any, path: str) -> None:
    """Warn once per strategy, on rank 0, where a sharded save writes a folder under a file's name
    (`final.pt`), naming the option that writes one file instead."""
    if not path.rstrip("/").lower().endswith(FILE_SUFFIXES) or strategy in _warned_of_file_names:
        return
    _warned_of_file_names.add(strategy)
    if strategy.global_rank != 0:
        return
    option = ("save_distributed_checkpoint=False"
              if "save_distributed_checkpoint" in inspect.signature(type(strategy)).parameters
              else "state_dict_type='full'")
    warn_user(f"save() writes '{path}' as a folder of shards, not one file, under strategy={strategy.name!r}:"
              f" pass {type(strategy).__name__}({option}) to write one file, or save to a name without a file"
              " suffix to keep the shards.")


# -- load ---------------------------------------------------------------------------------------
def load(strategy: ShardsCheckpoints, path: str, state: dict[str, Any] | None, strict: bool,
         weights_only: bool, checkpoint_io: CheckpointIO, precision: Precision) -> dict[str, Any]:
    """Restore `state`'s objects (and `precision`'s state) from a sharded or full checkpoint read
    with `checkpoint_io`; return the content."""
    store = store_for(path)
    sharded = is_sharded(path)  # first: a sharded checkpoint needs no other check (one request at a URL)
    if not sharded and not store.exists(path):
        raise store.missing(path)
    if state is None:
        if sharded:
            return read_sharded(path, checkpoint_io, weights_only)
        return read_checkpoint(path, checkpoint_io, weights_only)
    objects, plain = _split(state)
    if sharded:
        content = _load_sharded(strategy, path, objects, strict, weights_only, plain, checkpoint_io)
    else:
        content = read_checkpoint(path, checkpoint_io, weights_only)
        _check_keys(objects, content, strict)
        for key, obj in objects.items():
            if key in content:
                _load_into(strategy, obj, content[key], full=True, strict=strict)
    restore(plain, content, strict=strict, precision=precision)
    state.update(plain)
    return content


def _load_sharded(strategy: ShardsCheckpoints, path: str, objects: dict[str, Any], strict: bool,
                  weights_only: bool, plain: dict[str, Any], checkpoint_io: CheckpointIO) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException

    store = store_for(path)
    content = checkpoint_io.load(store.join(path, EXTRA_FILE), weights_only=weights_only)
    reader = reading_metadata_once(storage_reader(path, weights_only, store))
    metadata = reader.read_metadata().state_dict_metadata
    saved = set(metadata)
    top_level = {fqn.split(".", 1)[0] for fqn in saved}
    _check_keys(objects, {**content, **dict.fromkeys(top_level)}, strict)
    targets = {key: _load_target(strategy, key, obj, saved) for key, obj in objects.items() if key in top_level}
    if strict:  # else torch's raw CheckpointException (missing keys) or nothing at all (unexpected keys)
        _check_sharded_keys(strategy, objects, targets, saved)
    _check_sharded_shapes(objects, targets, metadata)  # torch's would say "failed", as if the files were damaged
    # The user's values saved through torch distributed checkpoint (they held `DTensor`s), read into
    # the tensors the user passes for them: shards of the same layout, or whole tensors.
    values = {key: value for key, value in plain.items()
              if key in top_level and key not in content and _holds(value, Tensor)}
    targets.update(values)
    try:
        dcp.load(targets, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    except CheckpointException as err:  # a BaseException
        cause = first_failure(err)[1]
        raise CheckpointError(f"Reading the sharded checkpoint '{path}' failed with {_describe(cause)}: point load()"
                              " at a complete checkpoint that this process may read.") from None
    for key, obj in objects.items():
        if key in targets:
            _load_into(strategy, obj, targets[key], full=False, strict=strict)
    return {**content, **targets}


def _check_sharded_keys(strategy: ShardsCheckpoints, objects: dict[str, Any], targets: dict[str, Any],
                        saved: set[str]) -> None:
    """A `CheckpointError` where a module's keys differ from those the checkpoint holds for it (the
    whole model's keys, where this process holds a part: a pipeline stage)."""
    for key, target in targets.items():
        if not isinstance(objects[key], Optimizer):
            prefix = f"{key}."
            held = sorted(name[len(prefix):] for name in saved if name.startswith(prefix))
            check_module_keys(objects[key], strategy.whole_module_keys(objects[key]) or target, held)


def _check_sharded_shapes(objects: dict[str, Any], targets: dict[str, Any], metadata: dict[str, Any]) -> None:
    """A `CheckpointError` where a module's weight has another shape in the checkpoint than in the
    module (each compared whole: a `DTensor`'s shape is the whole tensor's, as the checkpoint's
    `.metadata` records it); weights that this process does not hold are not compared."""
    for key, target in targets.items():
        if not isinstance(objects[key], Optimizer):
            prefix = f"{key}."
            saved = {fqn[len(prefix):]: entry.size for fqn, entry in metadata.items()
                     if fqn.startswith(prefix) and hasattr(entry, "size")}
            check_module_shapes(objects[key], shapes_of(target), saved)


def _load_target(strategy: ShardsCheckpoints, key: str, obj: Any, saved: set[str]) -> Any:
    """The state dict that `dcp.load` fills for `obj`: the live object's, with an optimizer's
    per-parameter state only where the checkpoint has some (none: saved before the first step)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(obj, Optimizer):
        return get_model_state_dict(obj, options=_options(full=False))
    target = get_optimizer_state_dict(strategy.module_of(obj), obj, options=_options(full=False))
    if not any(fqn.startswith(f"{key}.state.") for fqn in saved):
        target = {**target, "state": {}}
    return target


def _check_keys(objects: dict[str, Any], content: dict[str, Any], strict: bool) -> None:
    missing = [key for key in objects if key not in content]
    if strict and missing:
        raise CheckpointError(f"The checkpoint has no entry for {missing}: save them too, or load with strict=False.")
