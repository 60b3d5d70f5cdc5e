"""The plugin interface: everything a backend package (or a third party) builds on.

A backend imports only from this module (and the other public modules of `lite_core`); the rest
of the core may change in any release. The names below follow semantic versioning together with
lite-core's version: adding a name is a minor change, removing one or changing what it does or
takes is a major change. A backend declares the core range it was written for in its own
`lite-core>=X,<Y` requirement, which the core checks when it loads the backend (by name or as
an instance passed to `LightningLite`).

What is here, by purpose:

- Base classes to derive from: `Accelerator` (and `CPUAccelerator`), `Strategy`,
  `SingleDeviceStrategy`, `DDPStrategy` (the base of every strategy that runs a
  `torch.distributed` process group, e.g. DeepSpeed's), `FSDPStrategy` (`fully_shard`, e.g. the
  base of torchft's HSDP), `Launcher`, `Precision`
  (`MixedPrecision`, `TruePrecision`), `ClusterEnvironment`, `CheckpointIO` (`TorchCheckpointIO`).
- Precisions: a strategy or accelerator declares what it carries as `precision_support =
  PrecisionSupport(families=..., true_dtypes=..., mixed_dtypes=..., hardware=...)` (an accelerator
  names its devices' hardware, `{"fp8"}` for FP8 matrix units), and its `supported_precisions` are
  the names of the precision table that fit (it may still set `supported_precisions` to names).
  A backend adds a precision with `register_precision(PrecisionEntry(...))`; `precision_names()`
  reads the table. The sets `PRECISIONS`, `FP8_PRECISIONS`, `QUANTIZED_PRECISIONS` (bitsandbytes'
  frozen 4- and 8-bit weights) and `SHARDED_QUANTIZED_PRECISIONS` (torchao's NF4) are the table's
  names when Lite is imported.
- Errors to raise: `LiteError` and its subclasses.
- Checkpoints: `to_state(content, precision)` (content with modules, optimizers and other stateful
  objects replaced by their state, and the job's precision's state under `PRECISION_KEY`),
  `restore(state, content, strict, precision)` (load state back into live objects and the
  precision), `read_checkpoint`,
  `on_rank_zero` (a rank-0 write whose failure every rank raises), `on_writing_ranks` (the
  same for a write that several ranks do, each its part or each host its copy), `PRECISION_KEY`, and
  `READER_FILE` (written into a backend's checkpoint directory, it names the strategy whose
  `read_whole_checkpoint` lets every strategy load that directory), `store_for` (the `Store` that
  keeps a checkpoint path, with its commit rule: `LocalStore` for local paths, `FsspecStore` for
  fsspec URLs; its `shared` says whether every node sees the same checkpoint there),
  `register_store` (a `Store` of a backend's own for a URL protocol), `is_url` (whether a path is
  an fsspec URL),
  `check_weights_fit` (the one sentence for a checkpoint whose keys or shapes do not fit the model,
  for an engine that loads weights its own way, with `shapes_of` for a state dict's shapes), and `enum_getattr` (the `getattr` a restricted
  unpickler allows so that members of the enums it allows, and nothing else, load).
  For an engine that writes a checkpoint folder itself: `is_sharded` (whether a folder is a
  sharded checkpoint), `staging_folder` and `commit_folder` (write beside the path, then replace
  what another strategy saved there, as every strategy's save does), `TrainableState` (the entry
  `trainable_state(model)` puts in the content: an adapters-only checkpoint) and `trainable_names`.
- Rank supervision for launchers: `start_rank`, `run_rank`, `own_copy`, `read_result`, `write_result`,
  `die_with_parent`, `on_interrupt`, `RankProcesses`, `describe_exit`.
- Set-up objects: `is_set_up`, `original_module`, `forward_module`, `unwrap_optimizer`, and
  `CompileOptions` (the user's `torch.compile` options that `Strategy.compile_module` applies).
- Environment variables a backend's engine reads: `export_environ` sets them and returns what
  they replaced, `restore_environ` puts that back (at teardown, say).
- Batches: `move_to_device`, the walk that moves tensors wherever they sit in a batch (dicts,
  lists, tuples, namedtuples, dataclasses, `.to()` objects), with the backend's way of moving one
  tensor.
- Process groups: `init_attempt_process_group` (and the `attempt_store` and `attempt_prefix` it
  builds on), which every strategy that creates a `torch.distributed` group uses, so that a group
  rebuilt after a restart never reads an earlier attempt's keys. `find_free_port` gives a port
  for a group's store that the kernel does not hand out by itself (it is drawn below the
  ephemeral range), for a launcher that starts several jobs on one machine.
- Collectives: `REDUCE_OPS` and `check_reduce_op` for strategies that implement `all_reduce`, and
  `reduce_on_one_process` for what it returns when there is one process.

See the "Writing a backend" guide in the documentation for how the pieces fit together.

Names load on first access, so importing this module costs nothing until a name is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lite_core.accelerators.accelerator import Accelerator
    from lite_core.accelerators.cpu import CPUAccelerator
    from lite_core.checkpoint import (
        PRECISION_KEY,
        READER_FILE,
        CheckpointIO,
        FsspecStore,
        LocalStore,
        Store,
        TorchCheckpointIO,
        TrainableState,
        check_weights_fit,
        commit_folder,
        enum_getattr,
        is_sharded,
        is_url,
        on_rank_zero,
        on_writing_ranks,
        read_checkpoint,
        register_store,
        restore,
        shapes_of,
        stage_to_host,
        staging_folder,
        store_for,
        to_state,
    )
    from lite_core.environ import export_environ, restore_environ
    from lite_core.environments.environment import ClusterEnvironment
    from lite_core.environments.local import find_free_port
    from lite_core.errors import (
        BackendImportError,
        BackendNotInstalledError,
        CheckpointError,
        CollectiveTimeoutError,
        ConfigurationError,
        IncompatibleBackendError,
        LiteError,
        MisuseError,
        MissingDependencyError,
        UnknownNameError,
    )
    from lite_core.launchers.launcher import Launcher
    from lite_core.launchers.supervision import (
        RankProcesses,
        describe_exit,
        die_with_parent,
        on_interrupt,
        own_copy,
        read_result,
        run_rank,
        start_rank,
        write_result,
    )
    from lite_core.model.compile import CompileOptions
    from lite_core.model.optimizer import unwrap_optimizer
    from lite_core.model.parts import forward_module, is_set_up, original_module, trainable_names
    from lite_core.move import move_to_device
    from lite_core.precision.names import (
        FP8_PRECISIONS,
        PRECISIONS,
        QUANTIZED_PRECISIONS,
        SHARDED_QUANTIZED_PRECISIONS,
        PrecisionEntry,
        PrecisionSupport,
        precision_entry,
        precision_names,
        register_precision,
    )
    from lite_core.precision.precision import MixedPrecision, Precision, TruePrecision
    from lite_core.strategies.ddp import DDPStrategy
    from lite_core.strategies.fsdp import FSDPStrategy
    from lite_core.strategies.process_group import attempt_prefix, attempt_store, init_attempt_process_group
    from lite_core.strategies.single_device import SingleDeviceStrategy
    from lite_core.strategies.strategy import REDUCE_OPS, Strategy, check_reduce_op, reduce_on_one_process


def _homes() -> dict[str, str]:
    """Each public name and the module that defines it, read from the imports above: they are the
    one list of the interface (type checkers and import-linter read them as imports)."""
    import ast

    with open(__file__, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names}


_HOMES: dict[str, str] = _homes()
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'lite_core.plugins' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return __all__
