"""Fully sharded data parallel on PyTorch's `fully_shard`: parameters, gradients and optimizer
state are split across the processes and gathered only around each unit's forward and backward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core.checkpoint import CheckpointIO
from lite_core.checkpoint import _fsdp as _fsdp_checkpoint
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.precision.names import PrecisionSupport
from lite_core.precision.precision import Precision
from lite_core.strategies import _clip, _fsdp_init, _fsdp_optimizers
from lite_core.strategies.ddp import DDPStrategy
from lite_core.model.parts import trainable_names

_STATE_DICT_TYPES = ("sharded", "full")


class FSDPStrategy(DDPStrategy):
    """`strategy="fsdp"`: shards each process's share of the model with `fully_shard`.

    Processes are started and grouped exactly as for `ddp` (the script is re-run for the other
    local ranks). `setup(model, optimizer)` re-points an optimizer created before setup at the
    shards in place; with `setup_module`, create the optimizer from the returned model.

    Args:
        auto_wrap_policy: module classes that become their own sharded unit (e.g. your
            transformer block); the root module is always one. Each unit is gathered whole only
            while it runs, so smaller units mean less memory.
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory.
        state_dict_type: `"sharded"` (default) makes `save` write a directory with one shard per
            process (torch distributed checkpoint); `"full"` writes one `torch.load`-able file
            from rank 0, with the weights and any `DTensor` in your own values (an average of the
            parameters) gathered whole. `load` reads both kinds under any strategy and process
            count.
        reshard_after_forward: free the gathered parameters after the forward pass and gather
            them again for backward (less memory, more communication). `None` (default) is
            torch's choice: every sharded submodule reshards, the root module keeps its
            parameters for the backward pass that follows at once (one all-gather per step fewer).
        mixed_precision: a `torch.distributed.fsdp.MixedPrecisionPolicy` with which
            `fully_shard` casts the gathered parameters (and inputs, gradients, outputs) itself.
            By default it casts nothing: `precision="bf16-mixed"` then means what it means under
            `ddp`, float32 parameters with the forward pass under `torch.autocast`.
        timeout: how long a collective waits for the other ranks (see `DDPStrategy`).
        process_group_backend: overrides the accelerator's `torch.distributed` backend.
        replicate_size: hybrid sharding (HSDP): the processes form `replicate_size` groups; each
            group shards the model among its own processes, and the groups hold replicas of
            each other (gradients are averaged across them). `None` (default) shards over every
            process. It must divide the number of processes; e.g. the number of nodes, so that
            shards are exchanged only within a node.
        activation_checkpointing: module classes whose activations are recomputed in the backward
            pass (see `DDPStrategy`); applied before `fully_shard`, names and keys unchanged.
        activation_checkpointing_policy: torch's selective per-op policy (see `DDPStrategy`).
    """

    name = "fsdp"
    # XLA devices have their own sharding strategy (`xla_fsdp`).
    # Float16 autocast needs a gradient scaler that understands sharded gradients.
    precision_support = PrecisionSupport(families=frozenset({"true", "mixed", "fp8", "sharded-quantized"}),
                                         mixed_dtypes=frozenset({torch.bfloat16}))
    routes_module_methods = True  # `call_module_method` runs them inside FSDP's forward hooks
    routes_load_state_dict = True  # `load_module_state_dict` loads full weights into the shards
    stages_checkpoints = True  # `stage_checkpoint` stages what `save_checkpoint` writes
    fully_shards_parameters = True

    def __init__(self, auto_wrap_policy: set[type[nn.Module]] | None = None, cpu_offload: bool = False,
                 state_dict_type: str = "sharded", reshard_after_forward: bool | None = None,
                 timeout: float | timedelta | None = None, process_group_backend: str | None = None,
                 mixed_precision: Any = None, replicate_size: int | None = None,
                 activation_checkpointing: Any = None, activation_checkpointing_policy: Any = None) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend,
                         activation_checkpointing=activation_checkpointing,
                         activation_checkpointing_policy=activation_checkpointing_policy)
        _check_policy(mixed_precision)
        _check_replicate_size(replicate_size)
        self._replicate_size = replicate_size
        if state_dict_type not in _STATE_DICT_TYPES:
            raise ConfigurationError(
                f"state_dict_type={state_dict_type!r} is not supported: pass 'sharded' or 'full'."
            )
        self._wrap_classes = tuple(auto_wrap_policy or ())
        self._cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type
        self._reshard_after_forward = reshard_after_forward
        self._mixed_precision = mixed_precision
        self._sharded_modules: list[nn.Module] = []
        self._names_before_sharding: list[_fsdp_optimizers.NamesBeforeSharding] = []
        #: (id of a sharded module, method name) -> torch's forward-method wrapper of it.
        self._forward_methods: dict[tuple[int, str], Any] = {}
        self._init_rng_state: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def connect(self, accelerator: Any, environment: Any, device_indexes: list[int], num_nodes: int) -> None:
        super().connect(accelerator, environment, device_indexes, num_nodes)
        processes = len(device_indexes) * num_nodes
        if self._replicate_size is not None and processes % self._replicate_size:
            raise ConfigurationError(
                f"replicate_size={self._replicate_size} does not divide the {processes} processes into equal"
                " groups: choose a replicate_size that divides devices x num_nodes."
            )

    # -- modules -------------------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None, *, precision: Precision) -> ContextManager[Any]:
        if not empty_init:
            return super().module_init_context(empty_init, precision=precision)
        stack = ExitStack()
        self._init_rng_state = _fsdp_init.capture_rng(self.root_device)
        stack.enter_context(self.root_device)
        stack.enter_context(_fsdp_init.parameters_on_meta())
        stack.enter_context(precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> nn.Module:
        if self._cpu_offload or _fsdp_init.has_meta_tensors(module):
            return module  # fully_shard places the shards; a meta module has nothing to move yet
        return super().module_to_device(module)

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        on_meta = _fsdp_init.has_meta_tensors(module)
        if on_meta:
            _fsdp_init.check_reinitialisable(module)
        self._apply_recompute(module)
        options = self._shard_options()
        self._names_before_sharding.append(_fsdp_optimizers.NamesBeforeSharding(module))
        for submodule in reversed(list(module.modules())):
            if submodule is not module and isinstance(submodule, self._wrap_classes):
                fully_shard(submodule, **options)
        fully_shard(module, **options)
        if on_meta:
            shard_device = torch.device("cpu") if self._cpu_offload else self.root_device
            _fsdp_init.materialise(module, shard_device, self.root_device, self._init_rng_state)
        self._sharded_modules.append(module)
        return module

    def call_module_method(self, forward_module: nn.Module, module: nn.Module, name: str,
                           *args: Any, **kwargs: Any) -> Any:
        """The method runs between FSDP's pre- and post-forward work on the root module
        (gathering its parameters, then freeing them), through torch's
        `register_fsdp_forward_method`, which this registers once per method."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        if module not in self._sharded_modules:
            return getattr(module, name)(*args, **kwargs)
        key = (id(module), name)
        if key not in self._forward_methods:
            register_fsdp_forward_method(module, name)
            # torch installs its wrapper on the instance; kept here instead, so that the user's
            # `model.<name>(...)` keeps reaching the set-up model's method, which calls this.
            # (A module that fully_shard did not wrap gets nothing: its method runs as it is.)
            self._forward_methods[key] = module.__dict__.pop(name, None) or getattr(module, name)
        return self._forward_methods[key](*args, **kwargs)

    def _shard_options(self) -> dict[str, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        device_type = self.root_device.type
        if self._replicate_size is None:
            mesh = init_device_mesh(device_type, (self.world_size,))
        else:  # a 2-D mesh makes fully_shard replicate across its first dimension and shard along the second
            mesh = init_device_mesh(device_type, (self._replicate_size, self.world_size // self._replicate_size),
                                    mesh_dim_names=("replicate", "shard"))
        # Pinned memory speeds up copies to an accelerator; with the CPU as the device there is none.
        offload = CPUOffloadPolicy(pin_memory=device_type != "cpu") if self._cpu_offload else OffloadPolicy()
        return {
            "mesh": mesh,
            "reshard_after_forward": self._reshard_after_forward,
            "mp_policy": self._mp_policy(),
            "offload_policy": offload,
        }

    def _mp_policy(self) -> Any:
        """The policy passed as `mixed_precision`, or one that casts nothing."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return self._mixed_precision if self._mixed_precision is not None else MixedPrecisionPolicy()

    def full_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The shards gathered whole onto rank 0's CPU (torch's `get_model_state_dict`). On a CPU,
        torch hands back the module's own memory wherever nothing had to be gathered (buffers,
        which are not sharded; everything on one process): those tensors are copied, so that the
        result is a copy under every strategy, as `ddp`'s is."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if module not in self._sharded_modules:
            return super().full_module_state_dict(module)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return _copy_shared(module, get_model_state_dict(module, options=options))

    def full_trainable_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Only the parameters that train are gathered (torch's `ignore_frozen_params`): an
        adapters' checkpoint of a large frozen base never brings the base whole onto rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if module not in self._sharded_modules or self.whole_module_keys(module) is not None:
            return super().full_trainable_state_dict(module)  # a pipeline stage's part: through the whole state
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        gathered = _copy_shared(module, get_model_state_dict(module, options=options))
        return {name: gathered[name] for name in trainable_names(module) if name in gathered}  # buffers stay out

    def load_module_state_dict(self, module: nn.Module, state_dict: Any, strict: bool = True,
                               assign: bool = False) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor

        if module not in self._sharded_modules or any(isinstance(v, DTensor) for v in state_dict.values()):
            return super().load_module_state_dict(module, state_dict, strict=strict, assign=assign)
        # Full (unsharded) weights: each process keeps its shard of them.
        options = StateDictOptions(full_state_dict=True, strict=strict)
        return set_model_state_dict(module, dict(state_dict), options=options)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], *,
                                    precision: Precision) -> tuple[nn.Module, list[Optimizer]]:
        """Shard `module` and re-point each optimizer, in place, at the shards of the parameters
        it held: the same object keeps its class, param groups, hyperparameters and state
        (sharded like the parameters), so LR schedulers built on it before setup keep working."""
        moves = [_fsdp_optimizers.capture(optimizer, module) for optimizer in optimizers]
        sharded = self.setup_module(module, precision=precision)
        for move in moves:
            move.onto(sharded)
        return sharded, [self.setup_optimizer(optimizer) for optimizer in optimizers]

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        from torch.distributed.tensor import DTensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        if all(isinstance(p, DTensor) for p in params) or self._repoint_built_before_setup(optimizer):
            return optimizer
        raise MisuseError(
            f"This optimizer holds parameters of no model that strategy={self.name!r} sharded, or stepped before"
            " setup: create it from the parameters of a model set up with setup_module(), and call"
            " setup_optimizers() before its first step."
        )

    def _repoint_built_before_setup(self, optimizer: Optimizer) -> bool:
        """Re-point an optimizer built before `setup_module()` at the shards, as `setup()` does;
        whether it held the parameters of a module set up here (and had not stepped)."""
        for names in self._names_before_sharding:
            move = names.move(optimizer)
            if move is not None:
                move.onto(names.module)
                return True
        return False

    def no_backward_sync(self, module: nn.Module) -> ContextManager[Any]:
        return _no_gradient_sync(module)

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True, *,
                            precision: Precision) -> torch.Tensor:
        # One norm over every parameter, whatever its mesh and placements (see `_clip`).
        precision.unscale_gradients(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        error_if_nonfinite = error_if_nonfinite and not precision.skips_nonfinite_steps
        return _clip.clip_grad_norm(parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> None:
        if self.state_dict_type == "full":
            _fsdp_checkpoint.save_full(self, path, content, checkpoint_io, precision)
        else:
            _fsdp_checkpoint.save_sharded(self, path, content, checkpoint_io, precision)

    def stage_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                         precision: Precision) -> Callable[[], None]:
        """Sharded: torch distributed checkpoint's `async_save`; full: gathered to rank 0 and copied."""
        if self.state_dict_type == "full":
            return _fsdp_checkpoint.stage_full(self, path, content, checkpoint_io, precision)
        return _fsdp_checkpoint.stage_sharded(self, path, content, checkpoint_io, precision)

    def load_checkpoint(self, path: str, state: dict[str, Any] | None = None, strict: bool = True,
                        weights_only: bool = True, *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> dict[str, Any]:
        return _fsdp_checkpoint.load(self, path, state, strict=strict, weights_only=weights_only,
                                     checkpoint_io=checkpoint_io, precision=precision)

    def module_of(self, optimizer: Optimizer) -> nn.Module:
        """The sharded module whose parameters `optimizer` updates."""
        first = optimizer.param_groups[0]["params"][0]
        for module in self._sharded_modules:
            if any(p is first for p in module.parameters()):
                return module
        raise MisuseError(
            f"This optimizer updates no model set up by strategy={self.name!r}: create it from the parameters"
            " of the model returned by setup_module()."
        )

    def parameter_names_before_split(self, optimizer: Optimizer) -> list[list[str]] | None:
        """The names, in the whole model, of the parameters `optimizer` held per param group, where
        this process holds only a part of the model; `None` where it holds all of them."""
        return None

    def whole_module_keys(self, module: nn.Module) -> list[str] | None:
        """The state-dict keys of the whole model that `module` (what `setup_module` returned) is a
        part of, where this process holds only a part of it; `None` where it holds every key."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(state_dict_type={self.state_dict_type!r}, timeout={self.timeout})"


def _check_replicate_size(size: Any) -> None:
    if size is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        return
    raise ConfigurationError(f"replicate_size={size!r} is not valid: pass a positive integer, or None to shard over every process.")


def _check_policy(policy: Any) -> None:
    if policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise ConfigurationError(
            f"mixed_precision={policy!r} is not a policy: pass a torch.distributed.fsdp.MixedPrecisionPolicy"
            " such as MixedPrecisionPolicy(param_dtype=torch.bfloat16), or None."
        )


@contextmanager
def _no_gradient_sync(module: nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _copy_shared(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` with a copy of every tensor that shares memory with `module`'s parameters (their
    local shards) or buffers."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def storages(tensor: torch.Tensor) -> set[int]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if is_traceable_wrapper_subclass(local):  # torchao's NF4Tensor: the memory is its inner tensors'
            return set().union(*(storages(getattr(local, name)) for name in local.__tensor_flatten__()[0]))
        return {local.untyped_storage().data_ptr()}

    own = set().union(*(storages(tensor) for tensor in (*module.parameters(), *module.buffers())))
    return {name: value.detach().clone() if isinstance(value, torch.Tensor) and storages(value) & own else value
            for name, value in state.items()}
