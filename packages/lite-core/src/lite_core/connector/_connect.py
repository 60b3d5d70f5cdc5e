"""Joins the user's accelerator, strategy, devices and precision into the job's `Plan`.

Every decision reads what the classes declare (`Accelerator.priority`, `.supported_precisions`,
`.default_distributed_strategy`, `.default_interactive_strategy`, `.default_single_device_strategy`,
`.distributed_backend`,
`Strategy.supported_accelerators`, `.needs_process_group`, `.supported_process_group_backends`,
`.supported_precisions`, `.precision_type`, `.is_distributed`); no branch here names a particular
backend. The result is the job's `Plan` (`connector/_plan.py`).
"""

from __future__ import annotations

import os
from typing import Any

from lite_core.connector._defaults import LeftToLauncher
from lite_core.connector._plan import Plan
from lite_core._registry import ACCELERATORS, STRATEGIES, check_instance
from lite_core._user_frame import warn_user
from lite_core.accelerators.accelerator import Accelerator
from lite_core.environments import ClusterEnvironment, LocalEnvironment, detect_environment
from lite_core.errors import BackendImportError, ConfigurationError, IncompatibleBackendError
from lite_core.checkpoint import CheckpointIO, TorchCheckpointIO
from lite_core.precision._build import build_precision
from lite_core.precision.names import normalize_precision, precision_names, unsupported_hint
from lite_core.precision.precision import Precision
from lite_core.strategies.strategy import Strategy

_PLUGIN_KINDS = (Precision, ClusterEnvironment, CheckpointIO)


def connect(accelerator: Any, strategy: Any, devices: Any, num_nodes: Any, precision: Any,
            plugins: Any) -> Plan:
    """Resolve every choice and return the job's plan: accelerator, environment, precision,
    checkpoint IO, the connected strategy and its launcher. Every refusal is raised here.

    Accelerator and strategy names are case-insensitive (`"CPU"`, `"DDP"`). A `devices` or
    `num_nodes` that the caller left out is a `LeftToLauncher` value: it takes the count of the
    launcher that started the processes, if one did, else its default.
    """
    accelerator, strategy = _lowercase(accelerator), _lowercase(strategy)
    given = _sort_plugins(precision, plugins)
    environment = given.get(ClusterEnvironment) or detect_environment()
    devices, num_nodes = _launcher_counts(environment, devices, num_nodes)
    _check_num_nodes(num_nodes)
    if isinstance(strategy, Strategy):
        check_instance(strategy)
    strategy_cls = type(strategy) if isinstance(strategy, Strategy) else _strategy_class(strategy)
    accel = _accelerator(accelerator, strategy_cls)
    indexes = accel.parse_devices(devices)
    if strategy_cls is None:
        strategy_cls = STRATEGIES.load(_auto_strategy(accel, len(indexes) * num_nodes, environment))
    chosen = strategy if isinstance(strategy, Strategy) else strategy_cls()
    _check_strategy(chosen, accel, len(indexes), num_nodes)
    environment.validate_settings(len(indexes), num_nodes)
    _check_processes_to_start(environment, chosen, len(indexes), devices)
    _check_multi_node(environment, num_nodes, chosen)
    chosen.connect(accel, environment, indexes, num_nodes)
    plugin = _given_precision(chosen, accel, given[Precision]) if Precision in given else \
        _precision(chosen, accel, precision)
    _connect_precision(plugin, chosen, accel, indexes)
    checkpoint_io = given[CheckpointIO] if CheckpointIO in given else TorchCheckpointIO()
    return Plan(accelerator=accel, environment=environment, precision=plugin, checkpoint_io=checkpoint_io,
                strategy=chosen, launcher=chosen.launcher, device_indexes=tuple(indexes), num_nodes=num_nodes,
                mesh_layout=chosen.mesh_layout)


def _connect_precision(plugin: Precision, strategy: Strategy, accel: Accelerator, indexes: list[int]) -> None:
    """Tell the precision plugin where it runs, and refuse it where this hardware cannot run it."""
    plugin.connect(accel.autocast_device_type)
    plugin.connect_sharding(strategy.fully_shards_parameters)
    if not plugin.emulated:
        accel.validate_precision(plugin.name, indexes)
    if plugin.hardware_features:
        accel.validate_hardware(plugin.hardware_features, indexes)


def _launcher_counts(environment: ClusterEnvironment, devices: Any, num_nodes: Any) -> tuple[Any, Any]:
    """`devices` and `num_nodes`, those left to the launcher (`LeftToLauncher`) resolved: the
    launcher's counts where one started the processes, else their defaults."""
    left = isinstance(devices, LeftToLauncher) or isinstance(num_nodes, LeftToLauncher)
    per_node, nodes = (environment.process_counts() if left else None) or (None, None)
    return (devices.resolve(per_node) if isinstance(devices, LeftToLauncher) else devices,
            num_nodes.resolve(nodes) if isinstance(num_nodes, LeftToLauncher) else num_nodes)


def _lowercase(name: Any) -> Any:
    return name.strip().lower() if isinstance(name, str) else name


def _sort_plugins(precision: Any, plugins: Any) -> dict[type, Any]:
    items = list(plugins) if isinstance(plugins, (list, tuple)) else ([] if plugins is None else [plugins])
    if isinstance(precision, Precision):
        items.append(precision)
    given: dict[type, Any] = {}
    for item in items:
        kind = next((k for k in _PLUGIN_KINDS if isinstance(item, k)), None)
        if kind is None:
            raise ConfigurationError(
                f"plugins got {item!r}, which is not a Precision, ClusterEnvironment or CheckpointIO:"
                " pass accelerators and strategies as accelerator=... and strategy=... instead."
            )
        if kind in given:
            raise ConfigurationError(f"plugins holds two {kind.__name__} objects: pass only one.")
        given[kind] = item
    return given


def _check_num_nodes(num_nodes: Any) -> None:
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ConfigurationError(f"num_nodes={num_nodes!r} is not valid: pass a positive integer, e.g. num_nodes=1.")


def _strategy_class(strategy: Any) -> type[Strategy] | None:
    if strategy == "auto" or strategy is None:
        return None
    if not isinstance(strategy, str):
        raise ConfigurationError(
            f"strategy={strategy!r} is neither a name nor a Strategy instance: pass e.g. strategy='ddp'."
        )
    return STRATEGIES.load(strategy)


def _accelerator(accelerator: Any, strategy_cls: type[Strategy] | None) -> Accelerator:
    if isinstance(accelerator, Accelerator):
        check_instance(accelerator)
        return accelerator
    if accelerator is None or accelerator == "auto":
        return _auto_accelerator(strategy_cls)()
    if not isinstance(accelerator, str):
        raise ConfigurationError(
            f"accelerator={accelerator!r} is neither a name nor an Accelerator instance: pass e.g. accelerator='cpu'."
        )
    accel_cls = ACCELERATORS.load(accelerator)
    if not accel_cls.is_available():
        raise ConfigurationError(
            f"accelerator={accelerator!r} was requested but {accel_cls.unavailable_reason()}: use"
            " accelerator='auto' or 'cpu'."
        )
    return accel_cls()


def _auto_accelerator(strategy_cls: type[Strategy] | None) -> type[Accelerator]:
    named = strategy_cls.supported_accelerators if strategy_cls is not None else None
    candidates = []
    for name in ACCELERATORS.names():
        if named is not None and name not in named:
            continue  # not even imported
        try:
            accel_cls = ACCELERATORS.load(name)
        except (BackendImportError, IncompatibleBackendError) as err:
            warn_user(f"Skipping an unusable backend while choosing accelerator='auto': {err}")
            continue
        if accel_cls.is_available() and (strategy_cls is None or strategy_cls.why_not_on(accel_cls) is None):
            candidates.append(accel_cls)
    if not candidates:
        assert strategy_cls is not None  # the CPU accelerator runs every strategy that names none
        raise ConfigurationError(
            f"No available accelerator supports the chosen strategy (it runs on {strategy_cls.describe_accelerators()}):"
            " install and set up one of those, or choose another strategy."
        )
    return max(candidates, key=lambda cls: cls.priority)


def _auto_strategy(accel: Accelerator, processes: int, environment: ClusterEnvironment) -> str:
    """The strategy name `strategy="auto"` means here, from the accelerator's declarations."""
    if processes == 1:
        return accel.default_single_device_strategy
    if environment.creates_processes_externally:
        return accel.default_distributed_strategy
    from lite_core.launchers.script import can_rerun_script

    return accel.default_distributed_strategy if can_rerun_script() else accel.default_interactive_strategy


def _check_strategy(strategy: Strategy, accel: Accelerator, num_devices: int, num_nodes: int) -> None:
    reason = strategy.why_not_on(accel)
    if reason is not None:
        raise ConfigurationError(
            f"strategy={strategy.name!r} does not run on accelerator={accel.name!r}: {reason}."
        )
    processes_per_node = 1 if strategy.drives_devices_from_one_process else num_devices
    if not strategy.is_distributed and processes_per_node * num_nodes > 1:
        raise ConfigurationError(
            f"strategy={strategy.name!r} runs one process but devices={num_devices}, num_nodes={num_nodes}"
            " ask for more: use strategy='ddp' (or 'auto'), or devices=1."
        )


def _check_processes_to_start(environment: ClusterEnvironment, strategy: Strategy, num_devices: int,
                              devices: Any) -> None:
    """Refuse, before any process starts, more processes than this machine's cores can run, where
    Lite (or `lite run`) is the one to start them (a scheduler's ranks have started already, each
    maybe bound to a core of its own)."""
    if environment.creates_processes_externally:
        return
    from lite_core.launchers._cores import check_process_count

    named = devices if isinstance(devices, (int, str)) else num_devices  # not a list of 1000 indexes
    check_process_count(1 if strategy.drives_devices_from_one_process else num_devices, named)


def _check_multi_node(environment: ClusterEnvironment, num_nodes: int, strategy: Strategy) -> None:
    # Only a torch.distributed process group meets at MASTER_ADDR; other strategies (e.g. XLA's,
    # whose runtime knows the pod) find their nodes themselves.
    if num_nodes > 1 and strategy.needs_process_group and isinstance(environment, LocalEnvironment):
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if v not in os.environ]
        if missing:
            raise ConfigurationError(
                f"num_nodes={num_nodes} without a cluster scheduler needs {', '.join(missing)} set on every"
                " node: export MASTER_ADDR and MASTER_PORT of node 0 and each node's NODE_RANK (or use"
                " torchrun or SLURM)."
            )


def _precision(strategy: Strategy, accel: Accelerator, precision: Any) -> Precision:
    """The plugin for a precision given by name: the one the strategy declares it needs
    (`Strategy.precision_type`), else the one the precision table builds for the name."""
    name = normalize_precision(precision)
    _check_supported(strategy, accel, name, emulated=False)
    strategy.check_precision(name)
    needed = type(strategy).precision_type
    return needed(name) if needed is not None else build_precision(name, accel.autocast_device_type)


def _given_precision(strategy: Strategy, accel: Accelerator, precision: Precision) -> Precision:
    """A precision plugin the user built: checked like its name where it asks to be."""
    if precision.checked_by_name:
        _check_supported(strategy, accel, precision.name, emulated=precision.emulated)
    return precision


def _check_supported(strategy: Strategy, accel: Accelerator, name: str, emulated: bool) -> None:
    on_device = precision_names() if emulated else accel.supported_precisions
    supported = strategy.supported_precisions & on_device
    if name not in supported:
        hint = unsupported_hint(name, by_strategy=name not in strategy.supported_precisions)
        raise ConfigurationError(
            f"precision={name!r} is not supported by strategy={strategy.name!r} on accelerator={accel.name!r}:"
            f" choose one of {sorted(supported)}{hint}."
        )
