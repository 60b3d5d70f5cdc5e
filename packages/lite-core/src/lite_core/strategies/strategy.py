"""The strategy: how the model, optimizers and collectives are spread over processes."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, nullcontext
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map_only

from lite_core.model._methods import call_through
from lite_core.model.parts import trainable_names
from lite_core.move import move_to_device
from lite_core.checkpoint import CheckpointIO, read_checkpoint, restore, to_state
from lite_core.checkpoint._background import nothing, stage_to_host
from lite_core.checkpoint._plain import plain_tensors
from lite_core.checkpoint._rank_zero import on_rank_zero
from lite_core.precision.names import FAMILIES, PrecisionSupport, SupportedPrecisions
from lite_core.precision.precision import Precision

if TYPE_CHECKING:
    from lite_core.parallel import MeshLayout
    from lite_core.model.compile import CompileOptions
    from lite_core.accelerators.accelerator import Accelerator
    from lite_core.environments.environment import ClusterEnvironment
    from lite_core.launchers.launcher import Launcher


#: The `reduce_op` names `all_reduce` accepts.
REDUCE_OPS = ("sum", "mean", "max", "min", "product")


def check_reduce_op(reduce_op: str) -> None:
    """Raise a `MisuseError` for a `reduce_op` that is not one of `REDUCE_OPS`."""
    if reduce_op not in REDUCE_OPS:
        from lite_core.errors import MisuseError

        raise MisuseError(f"reduce_op={reduce_op!r} is not supported: use one of {sorted(REDUCE_OPS)}.")


def reduce_on_one_process(tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """What `all_reduce` returns when this process is the only one: a new tensor, as a real
    reduction returns, so changing it leaves the input alone; a mean divides (an integer
    tensor's mean is a floating-point tensor) as it does over several processes."""
    return tensor / 1 if reduce_op == "mean" else tensor.clone()


class Strategy:
    """Declares what it supports; the connector checks the user's choice against it.

    Backends register subclasses under the `lite_core.strategies` entry-point group.
    """

    #: The name users pass as `strategy=...`.
    name: ClassVar[str]
    #: Accelerator names this strategy runs on; `None` means any accelerator that meets the
    #: requirements below. Core strategies leave it `None` and declare capabilities instead; a
    #: backend's own strategy may name its own accelerators.
    supported_accelerators: ClassVar[frozenset[str] | None] = None
    #: Whether the strategy needs the accelerator to run a `torch.distributed` process group
    #: (`Accelerator.distributed_backend` is not `None`).
    needs_process_group: ClassVar[bool] = False
    #: The `torch.distributed` backends the strategy works over; `None` means any.
    supported_process_group_backends: ClassVar[frozenset[str] | None] = None
    #: What this strategy carries. Not torchao's NF4 by default: DDP's broadcast of the
    #: parameters at setup overwrites an `NF4Tensor`'s statistics with garbage (measured with torch
    #: 2.13 and torchao 0.18), so only the strategies that keep one process or shard with FSDP2 add it.
    precision_support: ClassVar[PrecisionSupport] = PrecisionSupport(families=FAMILIES - {"sharded-quantized"})
    #: The names of the precisions `precision_support` accepts (read from the precision table).
    supported_precisions: ClassVar[frozenset[str]] = SupportedPrecisions()  # type: ignore[assignment]
    #: The precision plugin this strategy's engine needs, built by the connector as
    #: `precision_type(name)` for a precision the user names (e.g. lite-deepspeed's
    #: `DeepSpeedPrecision`, whose engine applies the dtype itself). `None`, the default: the plugin
    #: that the precision's row in the table (`lite_core.precision.names`) builds.
    precision_type: ClassVar[Callable[[str], Precision] | None] = None
    #: Whether the strategy drives more than one process.
    is_distributed: ClassVar[bool] = False
    #: Whether one process drives every device of `devices` (e.g. `torch.nn.DataParallel`).
    drives_devices_from_one_process: ClassVar[bool] = False
    #: Whether `backward` must be told which model the loss belongs to when several are set up
    #: (e.g. DeepSpeed, where each model has its own engine that runs the backward pass).
    backward_needs_model: ClassVar[bool] = False
    #: Whether training stays correct when the set-up model's dtype or device changes after
    #: setup (`model.double()`); where not, the set-up model refuses the change.
    follows_conversions: ClassVar[bool] = True
    #: Whether a trainable parameter added to the set-up model after setup (a new head) is
    #: synchronised like the others; where not, the set-up model refuses it.
    follows_new_parameters: ClassVar[bool] = True
    # What the strategy's own methods change, declared rather than inferred from which methods a
    # subclass overrides (a subclass that overrides one only to log keeps the plain routing). A
    # strategy that overrides one of the methods below declares its attribute in its own class.
    #: Whether `backward` does more than the precision's backward pass (DeepSpeed's engine, a
    #: pipeline schedule). Default `False`: with a precision whose `changes_backward` is `False`
    #: too, one process's `LightningLite.backward` calls `loss.backward()` directly.
    changes_backward: ClassVar[bool] = False
    #: Whether `batch_to_device` is the plain move of this base class. Default `True`: a set-up
    #: loader moves its batches itself without asking the strategy; `False` (XLA's device loader)
    #: has it call `batch_to_device` for every batch.
    moves_batches_plainly: ClassVar[bool] = True
    #: Whether `optimizer_step` is the plain step through the precision. Default `True`: with a
    #: precision whose `changes_optimizer_step` is `False`, a set-up optimizer's `step` is the
    #: user's own; `False` has every step go through `optimizer_step`.
    steps_optimizers_plainly: ClassVar[bool] = True
    #: Whether the set-up model runs its forward methods (`model.generate(...)`, those named in
    #: `setup(forward_methods=...)`) through `call_module_method`, even with no wrapper. Default
    #: `False`: only where something wraps or changes the forward pass (see `call_module_method`).
    routes_module_methods: ClassVar[bool] = False
    #: Whether the set-up model's `load_state_dict` goes through `load_module_state_dict`.
    #: Default `False`: it is the module's own.
    routes_load_state_dict: ClassVar[bool] = False
    #: Whether the set-up model's `named_parameters()` (and `parameters()`) yields what
    #: `module_named_parameters` yields. Default `False`: they are the module's own.
    routes_named_parameters: ClassVar[bool] = False
    #: Whether `stage_checkpoint` copies to host memory what `save_checkpoint` writes, so that
    #: `save(blocking=False)` writes in the background. Default `True`, which the base class's
    #: pair of methods meets; a strategy that overrides `save_checkpoint` and not
    #: `stage_checkpoint` declares `False` (`why_no_background_save` then says so).
    stages_checkpoints: ClassVar[bool] = True
    #: Whether the strategy shards parameters with FSDP2's `fully_shard`, so that a precision may
    #: all-gather them in its own format (torchao's float8 all-gather): `True` always, `None` where
    #: the user's own function decides (`model_parallel`'s `parallelize_fn`), `False` never.
    fully_shards_parameters: ClassVar[bool | None] = False
    #: Modules the strategy imports when it runs, each with the command that installs it
    #: (`lite env` marks a strategy whose module is missing).
    requirements: ClassVar[dict[str, str]] = {}
    #: Whether `save` and `load` take an fsspec URL (`s3://bucket/run/step-100`) as well as a local
    #: path under this strategy. Core strategies write through `CheckpointIO` and torch distributed
    #: checkpoint, which both reach any fsspec URL; a strategy whose engine writes only local
    #: files sets `False`, and Lite then refuses a URL before anything is written.
    checkpoint_urls: ClassVar[bool] = True
    #: Whether `load_safetensors` can read Hugging Face safetensors into the set-up modules: torch's
    #: state-dict helpers see their weights (plain, DDP, FSDP2, tensor parallel). A strategy whose
    #: engine holds the weights its own way (DeepSpeed's partitions, XLA's) sets `False`, and Lite
    #: refuses the call in one sentence.
    loads_safetensors: ClassVar[bool] = True
    #: Whether a model whose experts are under `lite_core.parallel.ExpertParallel` (each process
    #: holding other experts) may be set up. Default `False`: `setup` refuses it in one sentence.
    holds_expert_parallel: ClassVar[bool] = False

    @classmethod
    def why_not_on(cls, accelerator: Accelerator | type[Accelerator]) -> str | None:
        """Why this strategy cannot run on `accelerator` and what to do, as the end of an error
        sentence; `None` when it can. Built from the declarations above, so a new accelerator that declares what
        it can do needs no change to any strategy."""
        if cls.supported_accelerators is not None and accelerator.name not in cls.supported_accelerators:
            return f"choose one of {sorted(cls.supported_accelerators)} or another strategy"
        backend = accelerator.distributed_backend
        if cls.needs_process_group and backend is None:
            return ("it needs a torch.distributed process group, which this accelerator does not run: choose"
                    " another strategy or accelerator")
        allowed = cls.supported_process_group_backends
        if cls.needs_process_group and allowed is not None and backend not in allowed:
            return (f"it works over the {' or '.join(sorted(allowed))} process-group backend and this accelerator"
                    f" uses {backend!r}: choose another strategy or accelerator")
        return None

    @classmethod
    def describe_accelerators(cls) -> str:
        """The accelerators this strategy runs on, for error messages."""
        if cls.supported_accelerators is not None:
            return str(sorted(cls.supported_accelerators))
        backends = cls.supported_process_group_backends
        over = f" over {' or '.join(sorted(backends))}" if backends is not None else ""
        return f"accelerators that run a torch.distributed process group{over}"

    def __init__(self) -> None:
        self.accelerator: Accelerator | None = None
        self.environment: ClusterEnvironment | None = None
        self.device_indexes: list[int] = [0]
        self.num_nodes = 1
        self._environment_ready = False
        self._failed = False

    # -- wiring, done once by the connector -------------------------------------------------
    def connect(self, accelerator: Accelerator, environment: ClusterEnvironment,
                device_indexes: list[int], num_nodes: int) -> None:
        """Give the strategy the choices the connector resolved."""
        self.accelerator = accelerator
        self.environment = environment
        self.device_indexes = device_indexes
        self.num_nodes = num_nodes

    def check_precision(self, name: str) -> None:
        """Refuse, in one sentence (a `ConfigurationError`), the precision named `name` where this
        strategy's configuration cannot run it although its declarations accept it (a DeepSpeed
        config that names another dtype, a pipeline schedule that cannot scale the loss). The
        connector calls it once, after the declarations are checked; nothing is refused by default."""

    @property
    def launcher(self) -> Launcher | None:
        """What starts the processes; `None` runs the user's code in this process only."""
        return None

    @property
    def mesh_layout(self) -> MeshLayout | None:
        """The sizes of the named device mesh this strategy spreads the model over, once connected
        (`ModelParallelStrategy`'s `MeshLayout`, its `"auto"` sizes resolved); `None` for a strategy
        without such a mesh, the default."""
        return None

    # -- process ------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """The device this process computes on."""
        assert self.accelerator is not None
        return self.accelerator.get_device(self.device_indexes[self.local_rank])

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def environment_ready(self) -> bool:
        """Whether `setup_environment` has run in this process."""
        return self._environment_ready

    def setup_environment(self) -> None:
        """Prepare this process (device, process group); runs once per process."""
        if self._environment_ready:
            return
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        self._environment_ready = True

    def mark_failed(self) -> None:
        """Remember that this rank failed, so teardown skips steps that need every rank."""
        self._failed = True

    def teardown(self, failed: bool = False) -> None:
        """Undo `setup_environment`; `failed` skips steps that need every rank to be alive."""
        if self.accelerator is not None:
            self.accelerator.teardown()
        self._environment_ready = False

    # -- modules and optimizers ---------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None, *, precision: Precision) -> ContextManager[Any]:
        """Context in which the user builds modules: on the device, in `precision` (the job's).

        With `empty_init=True` the parameters are allocated but not initialised (for weights that
        are loaded right after); sharding strategies override this to build on the meta device.
        """
        stack = ExitStack()
        stack.enter_context(self.root_device)
        stack.enter_context(precision.module_init_context())
        if empty_init:
            from lite_core.model._empty_init import SkipInitialisation

            stack.enter_context(SkipInitialisation())
            stack.enter_context(precision.empty_init_context())
        return stack

    def run_context(self) -> ContextManager[Any]:
        """Context around the user's whole `run()`; nothing by default. Construction contexts
        (meta device, ZeRO-3 partitioning) belong in `module_init_context`, which applies inside
        `init_module()` only: the rest of `run()` sees plain torch."""
        return nullcontext()

    def module_to_device(self, module: nn.Module) -> nn.Module:
        """Move `module` to this process's device."""
        return module.to(self.root_device)

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        """Wrap `module` for this strategy (e.g. in DistributedDataParallel). `precision` is the
        job's, for a wrapper that must apply it itself (DataParallel's replica threads, DeepSpeed's
        engine config); the set-up model applies it to every forward pass anyway."""
        return module

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], *,
                                    precision: Precision) -> tuple[nn.Module, list[Optimizer]]:
        """Set up a module together with its optimizers (strategies such as DeepSpeed need both
        at once); by default `setup_module`, then `setup_optimizer` for each."""
        return self.setup_module(module, precision=precision), [self.setup_optimizer(o) for o in optimizers]

    def call_module_method(self, forward_module: nn.Module, module: nn.Module, name: str,
                           *args: Any, **kwargs: Any) -> Any:
        """Run `module.<name>(*args, **kwargs)`, a method of the user's `module`, as one forward
        pass of `forward_module` (what `setup_module` returned for it); the set-up model calls
        this for its forward methods (`model.generate(...)`, those named in
        `setup(forward_methods=...)`), inside the precision; other methods never reach it.

        By default the wrapper's forward runs once with its call of the user's module turned into
        the method (`DistributedDataParallel`, DeepSpeed's engine and any wrapper whose forward
        calls the module it holds); with no wrapper, the method runs as it is. A strategy whose
        work hangs on the module itself (FSDP's hooks) overrides this.
        """
        if forward_module is module:
            return getattr(module, name)(*args, **kwargs)
        return call_through(forward_module, module, name, args, kwargs)

    def compile_module(self, module: nn.Module, options: CompileOptions) -> nn.Module:
        """`module` (what `setup_module` returned) compiled with the options the user passed to
        `torch.compile`; the set-up model's forward calls the result. By default the whole
        wrapper is compiled (under DDP its forward, so that graph breaks fall at the gradient
        buckets); a strategy whose wrapper must stay eager compiles the module inside it instead."""
        return options.compile(module)

    def forward_call(self, forward_module: nn.Module, compiled: nn.Module | None,
                     loss_fn: Callable[..., torch.Tensor] | None) -> Callable[..., Any] | None:
        """What the set-up model's forward calls: `compiled` (or `forward_module` itself, `None`)
        and, with the `loss_fn` given to `setup`, a call that returns `loss_fn(output, target)`
        when the model is called with `target=`. A strategy that needs the target inside its
        forward pass (pipeline parallelism) overrides this."""
        if loss_fn is None:
            return compiled
        from lite_core.strategies._loss import ForwardWithLoss

        return ForwardWithLoss(compiled if compiled is not None else forward_module, loss_fn)


    def full_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """`module`'s whole state dict as plain tensors on the CPU, on rank 0 (an empty dict on the
        other ranks; every rank must call it). Here each rank holds the whole module: a copy of it."""
        if self.global_rank != 0:
            return {}
        return {name: value.detach().to("cpu", copy=True) for name, value in plain_tensors(module.state_dict()).items()}

    def full_trainable_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """What `full_module_state_dict` gives, for the parameters that train only (`requires_grad`:
        a LoRA adapter's, not the frozen base's). Here the whole state filtered; a sharding strategy
        overrides it to gather only these."""
        full = self.full_module_state_dict(module)
        return {name: full[name] for name in trainable_names(module) if name in full}

    def load_module_state_dict(self, module: nn.Module, state_dict: Any, strict: bool = True,
                               assign: bool = False) -> Any:
        """`module.load_state_dict` for the set-up model (sharding strategies also accept full weights)."""
        return module.load_state_dict(state_dict, strict=strict, assign=assign)

    def module_named_parameters(self, module: nn.Module, forward_module: nn.Module, prefix: str = "",
                                recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """What `named_parameters()`, and so `parameters()`, of the set-up model yields: the parameters
        an optimizer must hold to train it. These are the module's own; a strategy that moves them
        onto the wrapper it built (`forward_module`) overrides this to yield those instead."""
        return nn.Module.named_parameters(module, prefix, recurse, remove_duplicate)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Prepare `optimizer` for this strategy."""
        return optimizer

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        """What an epoch iterates: the dataloader, or a device loader around it (e.g. XLA's)."""
        return dataloader

    def batch_to_device(self, batch: Any) -> Any:
        """Move every tensor in `batch` to this process's device.

        Tensors and objects with a `.to(device)` method move wherever they sit in dicts, lists,
        tuples, namedtuples and dataclasses; a batch already on the device is returned as it is.
        """
        return move_to_device(batch, self.root_device)

    # The precision is the job's (`LightningLite(precision=...)`): the room that owns it hands it
    # to each call below (and to `module_init_context`, `setup_module*` and the checkpoints).
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, precision: Precision,
                 **kwargs: Any) -> None:
        """Backward pass through `precision`; `module` is what `setup_module` returned."""
        precision.backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, *, precision: Precision, **kwargs: Any) -> Any:
        """Step `optimizer` through `precision`."""
        return precision.optimizer_step(optimizer, **kwargs)

    def no_backward_sync(self, module: nn.Module) -> ContextManager[Any]:
        """Context in which backward passes skip gradient synchronisation."""
        return nullcontext()

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True, *,
                            precision: Precision) -> torch.Tensor:
        """Scale gradients so that their total norm is at most `max_norm`; returns the norm.

        A non-finite norm raises only when `precision` would not skip the step anyway (a
        gradient scaler's overflow is not an error: the step is skipped and the scale lowered).
        """
        precision.unscale_gradients(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        error_if_nonfinite = error_if_nonfinite and not precision.skips_nonfinite_steps
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float, *,
                             precision: Precision) -> None:
        """Clamp every gradient to `[-clip_val, clip_val]` (unscaled by `precision` first)."""
        precision.unscale_gradients(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_value_(parameters, clip_val)

    # -- collectives (identity on one process) ------------------------------------------------
    # `LightningLite` hands these methods tensors already on `root_device` (Python numbers turned
    # into tensors), alone or in dicts, lists, tuples and namedtuples; `broadcast` may get any
    # picklable object.
    def barrier(self, name: str | None = None) -> None:
        """Wait until every process arrives."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` from rank `src` on every process."""
        return obj

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Stack each tensor in `tensor` from every process along a new first dimension."""
        return tree_map_only(torch.Tensor, lambda t: t.unsqueeze(0).clone(), tensor)  # never a view of the input

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: str = "mean") -> Any:
        """Reduce each tensor in `tensor` over every process."""
        check_reduce_op(reduce_op)
        return tree_map_only(torch.Tensor, lambda t: reduce_on_one_process(t, reduce_op), tensor)

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """`num_replicas` and `rank` for a `DistributedSampler`, or `None` on one process."""
        return None

    def evaluation_sampler_kwargs(self) -> dict[str, int] | None:
        """Where `distributed_sampler_kwargs()` is `None` (training passes unsharded), the
        `num_replicas` and `rank` that evaluation passes shard over instead, so that summing
        over those processes gives what one process computes (e.g. the processes of one replica
        group, which holds a whole copy of the model). `None` (the default): evaluation passes
        are unsharded too."""
        return None

    def split_batch_part(self) -> tuple[int, int]:
        """Which part of the next global batch this process takes under
        `setup_dataloaders(split_batches=True)`: `(data-parallel rank, data-parallel size)`.

        Asked once per batch (where the loader draws its indices: with workers, ahead of the
        step), so a strategy whose number of live replicas changes may answer differently.
        The default is the data-parallel shard of `distributed_sampler_kwargs()`.
        """
        shard = self.distributed_sampler_kwargs()
        return (0, 1) if shard is None else (shard["rank"], shard["num_replicas"])

    def take_global_batches(self, dataloader: Iterable[Any]) -> bool:
        """Take over `setup_dataloaders(dataloader, split_batches=True)` where this distributed
        strategy leaves loaders unsharded (`distributed_sampler_kwargs()` is `None`): the strategy
        then cuts each of `dataloader`'s batches (the global batch) itself, in
        `process_dataloader`, which receives this same loader. Returns whether it does; called
        once per set-up loader. The default, `False`, has `setup_dataloaders` refuse the flag.
        """
        return False

    def loader_batches_consumed(self, dataloader: Iterable[Any]) -> int | None:
        """How many batches of `dataloader`'s pass under way the job has consumed, where this
        strategy counts them rather than the set-up loader (a fault-tolerant strategy counts the
        batches of committed steps: those of every process alive in them, none of a step that
        failed). `None`, the default: the set-up loader counts the batches it handed out."""
        return None

    def resume_loader(self, dataloader: Iterable[Any], epoch: int, batches: int) -> bool:
        """Resume `dataloader` `batches` batches into epoch `epoch` (a position `load` read from the
        set-up loader's entry) this strategy's own way, and return `True`: the set-up loader then
        skips nothing itself, so the position is applied once. `False`, the default: the set-up
        loader's sampler skips those samples."""
        return False

    def is_logging_process(self) -> bool:
        """Whether this process sends the job's metrics to the loggers (`lite.log`, `log_dict`, and
        what the tracker loggers send): global rank 0. A strategy whose replica groups each have a
        rank 0 names one of them, so that the job logs once (lite-torchft: the first group of the
        last quorum, so the logging moves to a live group when that one dies)."""
        return self.global_rank == 0

    def logging_round(self) -> int | None:
        """An id of the current choice of logging process, for a strategy where that choice moves
        between processes during the job (lite-torchft: the quorum), else `None`, the default. Off
        the logging process, a tracker logger keeps the values logged since the round began, and
        sends those the tracker lacks if the logging comes to it in a later round: so the steps
        between a dying logging process's last word and the next round are not lost."""
        return None

    def carry_in_heals(self, name: str, state: Any) -> None:
        """For a strategy whose replica groups heal from a peer (lite-torchft): send `state` (an
        object with `state_dict()` and `load_state_dict(...)`) to a healing group along with the
        model, under `name`. Nothing by default. Lite hands it its tracker loggers' kept values: a
        group that heals past steps it never trained (it resumed behind a sync) then holds its
        peer's values of them, and sends them if the logging comes to it."""

    def fault_tolerance_figures(self) -> dict[str, float]:
        """What this strategy knows of the job's failures and recoveries, by metric name (e.g. a
        fault-tolerant strategy's `fault/replica_groups` in the last quorum and `fault/heals`):
        `ThroughputMonitor` puts them in each row it logs. The default: none."""
        return {}

    # -- checkpoints ----------------------------------------------------------------------------
    # The checkpoint IO and the precision are the job's (`LightningLite(plugins=MyCheckpointIO())`,
    # else `TorchCheckpointIO`; `precision=...`): Lite's checkpoint room holds them and hands them
    # to each call below. The precision's state (a gradient scaler's) is saved and restored with
    # the checkpoint under `PRECISION_KEY`.
    def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> None:
        """Write `content` and `precision`'s state to `path` on rank 0 with `checkpoint_io`;
        modules, optimizers (wrapped or not) and other objects with `state_dict()` are saved as
        their state dicts, with the user's keys.

        If writing fails on rank 0, every rank raises a `CheckpointError` naming that failure.
        """
        state = to_state(content, precision)
        on_rank_zero(self, path, lambda: checkpoint_io.save(state, path))

    def stage_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                         precision: Precision) -> Callable[[], None]:
        """The first half of `save(..., blocking=False)`: copy `content`'s state into host memory
        now (what `save_checkpoint` would write), and return the rest of the save, which Lite runs
        in a background thread on every rank and whose failure it then tells every rank.

        The returned function may not run collectives on the training process group (the training
        loop uses it meanwhile). A strategy that overrides `save_checkpoint` overrides this too, or
        declares `stages_checkpoints = False`, and `save(blocking=False)` then writes in the
        foreground with the warning `why_no_background_save` gives.
        """
        state = stage_to_host(to_state(content, precision))
        if self.global_rank != 0:
            return nothing
        return lambda: checkpoint_io.save(state, path)

    def why_no_background_save(self) -> str | None:
        """Why `save(blocking=False)` cannot write in the background under this strategy (the end
        of a warning sentence), or `None` when it can."""
        if not self.stages_checkpoints:
            return (f"{type(self).__name__} writes its checkpoints its own way and has no stage_checkpoint"
                    " that copies them to host memory first")
        return None

    def load_checkpoint(self, path: str, state: dict[str, Any] | None = None, strict: bool = True,
                        weights_only: bool = True, *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> dict[str, Any]:
        """Read the checkpoint at `path` on every process with `checkpoint_io`, restore `state`'s
        objects and `precision`'s state in place and return the content."""
        content = read_checkpoint(path, checkpoint_io, weights_only)
        if state is not None:
            restore(state, content, strict=strict, precision=precision)
        return content

    @classmethod
    def missing_requirements(cls) -> dict[str, str]:
        """The entries of `requirements` whose module is not installed."""
        return {module: command for module, command in cls.requirements.items() if not _importable(module)}

    @classmethod
    def read_whole_checkpoint(cls, path: str, weights_only: bool = True) -> dict[str, Any]:
        """The whole content of a checkpoint directory in this strategy's own format, read in one
        process as a one-file checkpoint holds it (modules as full state dicts, optimizers keyed by
        parameter name), so that every strategy loads it. A strategy that writes such a directory
        overrides this and writes `READER_FILE`, holding its registered name, into the directory.
        With `weights_only` (`load`'s default) it refuses files that could run code when read."""
        from lite_core.errors import CheckpointError

        raise CheckpointError(f"'{path}' names strategy {cls.__name__}, which reads no checkpoint directory whole:"
                              " load it under the strategy that saved it.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or `sys.modules[name] = None`
        return False
