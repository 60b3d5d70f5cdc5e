"""Model parallelism: the user's own `parallelize_fn(model, device_mesh)` on a 2-D device mesh named
`("data_parallel", "tensor_parallel")`, typically torch's `parallelize_module` (tensor parallel)
within a node and `fully_shard` (FSDP2) over the data-parallel dimension; with
`pipeline_parallel_size > 1` the mesh gains a `"pipeline_parallel"` dimension and the model is cut
into stages (`_split`) run by a `torch.distributed.pipelining` schedule (`_pipeline`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core._experts import check_experts_averaged, count_loads_over
from lite_core.checkpoint import CheckpointIO, is_sharded
from lite_core.checkpoint.stores import store_for
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.model._meta import meta_copy
from lite_core.parallel import (
    CONTEXT_MESH_DIM_NAMES,
    DATA_CONTEXT_DIM_NAME,
    MESH_DIM_NAMES,
    PIPELINE_MESH_DIM_NAMES,
    MeshLayout,
)
from lite_core.precision.names import PrecisionSupport
from lite_core.precision.precision import Precision
from lite_core.strategies import _clip, _fsdp_init, _fsdp_optimizers
from lite_core.strategies.fsdp import FSDPStrategy
from lite_core.strategies.model_parallel import (
    _absent,
    _context,
    _mesh,
    _pipeline,
    _pipeline_backward,
    _pipeline_load,
    _rehearsal,
    _split,
)
from lite_core.strategies.model_parallel._context import ContextParallel
from lite_core.strategies.model_parallel._pipeline import PipelineForward

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lite_core.accelerators.accelerator import Accelerator
    from lite_core.environments.environment import ClusterEnvironment

#: Not looked up yet (`None` is an answer: no data-parallel group to check against).
_UNKNOWN = object()

__all__ = ["CONTEXT_MESH_DIM_NAMES", "MESH_DIM_NAMES", "PIPELINE_MESH_DIM_NAMES", "ModelParallelStrategy"]


class ModelParallelStrategy(FSDPStrategy):
    """`strategy=ModelParallelStrategy(parallelize_fn)`: your function parallelises the model on a
    2-D device mesh; Lite starts and groups the processes as for `ddp`.

    Processes are started as for `ddp` (`python train.py`, `lite run`, torchrun, SLURM). In
    `setup`, `parallelize_fn(model, device_mesh)` receives the model (on the device, or on the
    meta device inside `init_module(empty_init=True)`) and a `DeviceMesh` with dimensions
    `("data_parallel", "tensor_parallel")`; it returns the parallelised model, typically after
    `parallelize_module(model, device_mesh["tensor_parallel"], plan)` and
    `fully_shard(model, mesh=device_mesh["data_parallel"])`. Dataloaders are sharded by
    data-parallel rank: the ranks of one tensor-parallel group get the same batches.

    Args:
        parallelize_fn: `parallelize_fn(model, device_mesh) -> model`; under a pipeline it is
            applied to each stage's part, and `None` leaves the parts as they are (pipeline only).
        data_parallel_size: how many groups hold distinct data; `"auto"` means the number of
            nodes.
        tensor_parallel_size: how many processes split each layer; `"auto"` means the processes
            of one node.
        save_distributed_checkpoint: `True` (default) makes `save` write a directory with one shard
            per process (torch distributed checkpoint); `False` writes one `torch.load`-able
            file from rank 0. `load` reads both, and those of `fsdp`, `ddp` and one device, under
            any layout.
        timeout: how long a collective waits for the other ranks (see `DDPStrategy`).
        process_group_backend: overrides the accelerator's `torch.distributed` backend.
        pipeline_parallel_size: how many processes the model's stages are spread over (pipeline
            parallelism on `torch.distributed.pipelining`); `1` (default) means none. The mesh
            then has the dimensions `("pipeline_parallel", "data_parallel", "tensor_parallel")`,
            and `parallelize_fn` is applied to each stage's part of the model.
        pipeline_schedule: the schedule's name: `"GPipe"`, `"1F1B"` (default),
            `"Interleaved1F1B"` (several stages per process), `"LoopedBFS"`, `"InterleavedZeroBubble"`.
        microbatches: how many micro-batches each batch is cut into (it must divide the batch).
        split_points: the module names at which a new stage begins (e.g. `["blocks.2"]`; indexes
            for an `nn.Sequential`), one fewer than the stages; `None` cuts the model's largest `nn.ModuleList` /
            `nn.Sequential` (a transformer's blocks) evenly, with what comes before it on the
            first stage and what comes after it on the last.
        stages_per_rank: stages each process holds; `None` means 2 for the interleaved and looped
            schedules, 1 otherwise.
        loss_fn: `loss_fn(output, target)`, averaging over its batch, for `model(x, target=y)`;
            `setup(model, optimizer, loss_fn=...)` gives it too, under every strategy.
        activation_checkpointing: module classes whose activations are recomputed in the backward
            pass (see `DDPStrategy`); applied to your model before `parallelize_fn` (and before the
            pipeline cut), names and keys unchanged.
        activation_checkpointing_policy: torch's selective per-op policy (see `DDPStrategy`).
        context_parallel_size: how many processes split each sequence (context parallelism on
            torch's ring attention); `1` (default) means none. The mesh then has the dimensions
            `("data_parallel", "context_parallel", "tensor_parallel")` plus the flattened
            `"data_context_parallel"`, over which `parallelize_fn` must `fully_shard` the model.
            Every batch tensor of two or more dimensions is cut along dimension 1, and
            `F.scaled_dot_product_attention` runs as ring attention in the set-up model's forward
            and backward passes (GPUs only; no `attn_mask`). Not with a pipeline.
        context_parallel_buffers: buffers of the model cut along the sequence like the batches,
            by name and sequence dimension (e.g. `{"rope.freqs": 0}`, a non-persistent buffer as
            long as the training sequence).
        mesh: every size at once, as one `lite_core.parallel.MeshLayout` (e.g.
            `MeshLayout(pipeline=2, shard=2, tensor=2)`) instead of the `*_parallel_size` keywords,
            which build the same layout; passing both is refused.

    Example:
        >>> def parallelize(model, device_mesh):  # doctest: +SKIP
        ...     plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        ...     parallelize_module(model, device_mesh["tensor_parallel"], plan)
        ...     return fully_shard(model, mesh=device_mesh["data_parallel"])
        >>> LightningLite(strategy=ModelParallelStrategy(parallelize), devices=4)  # doctest: +SKIP
    """

    name = "model_parallel"
    # Float16 autocast needs a gradient scaler that understands gradients on a device mesh.
    precision_support = PrecisionSupport(families=frozenset({"true", "mixed", "fp8", "sharded-quantized"}),
                                         true_dtypes=frozenset({torch.float32, torch.bfloat16}),
                                         mixed_dtypes=frozenset({torch.bfloat16}))
    routes_module_methods = True  # `call_module_method` refuses them under a pipeline
    changes_backward = True  # under a pipeline backward adds the gradients the schedule computed
    fully_shards_parameters = None  # if at all, in the user's parallelize_fn
    holds_expert_parallel = True  # parallelize_fn shards experts over the mesh's expert dimension

    def __init__(self, parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
                 data_parallel_size: int | str = "auto", tensor_parallel_size: int | str = "auto",
                 save_distributed_checkpoint: bool = True, timeout: float | timedelta | None = None,
                 process_group_backend: str | None = None, pipeline_parallel_size: int = 1,
                 pipeline_schedule: str = "1F1B", microbatches: int | None = None,
                 split_points: list[str | int] | None = None, stages_per_rank: int | None = None,
                 loss_fn: Callable[..., Any] | None = None, activation_checkpointing: Any = None,
                 activation_checkpointing_policy: Any = None, context_parallel_size: int = 1,
                 context_parallel_buffers: Mapping[str, int] | None = None, mesh: MeshLayout | None = None) -> None:
        super().__init__(state_dict_type="sharded" if save_distributed_checkpoint else "full",
                         timeout=timeout, process_group_backend=process_group_backend,
                         activation_checkpointing=activation_checkpointing,
                         activation_checkpointing_policy=activation_checkpointing_policy)
        self._requested_layout = _mesh.requested(mesh, {
            "pipeline": pipeline_parallel_size, "shard": data_parallel_size, "context": context_parallel_size,
            "tensor": tensor_parallel_size})
        self._layout = self._requested_layout  # resolved by connect
        self._pipeline = _pipeline.options(self._layout.pipeline, pipeline_schedule, microbatches, split_points,
                                           stages_per_rank, loss_fn)
        if self._pipeline is not None:  # 16-mixed is refused by check_precision with a sentence of its own
            self.precision_support = self.precision_support.replace(mixed_dtypes=frozenset({torch.bfloat16, torch.float16}))
        self._pipelines: dict[int, PipelineForward] = {}
        #: Per optimizer set up with a pipeline's model: its parameters' names in the whole model.
        self._names_before_split: dict[int, list[list[str]]] = {}
        #: Per model set up with a pipeline: the whole model's state-dict keys, before the cut.
        self._keys_before_split: dict[int, list[str]] = {}
        if self._pipeline is not None and not save_distributed_checkpoint:
            raise ConfigurationError(
                "save_distributed_checkpoint=False cannot gather a pipeline's stages into one file on rank 0: keep"
                " save_distributed_checkpoint=True and write one file with `lite consolidate CHECKPOINT OUT.pt`."
            )
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ConfigurationError(
                f"parallelize_fn={parallelize_fn!r} is not callable: pass a function"
                " parallelize_fn(model, device_mesh) that returns the parallelised model."
            )
        self._parallelize_fn = parallelize_fn
        self._context_buffers = _context.check_buffers(context_parallel_buffers)
        self._context: ContextParallel | None = None
        self._device_mesh: DeviceMesh | None = None
        self._replica_group: Any = _UNKNOWN

    # -- layout --------------------------------------------------------------------------------
    def connect(self, accelerator: Accelerator, environment: ClusterEnvironment,
                device_indexes: list[int], num_nodes: int) -> None:
        super().connect(accelerator, environment, device_indexes, num_nodes)
        # Sizes that do not make the world size are refused here, at construction.
        self._layout = self._requested_layout.resolve(len(self.device_indexes), self.num_nodes)

    @property
    def pipeline_parallel_size(self) -> int:
        """How many processes the model's stages are spread over (1: no pipeline)."""
        return self._layout.pipeline

    @property
    def mesh_layout(self) -> MeshLayout:
        """The mesh's sizes by name (pipeline x data (replicate x shard) x context x tensor): the
        `MeshLayout` given as `mesh=` or built from the size keywords, `"auto"` resolved against the
        world size once the strategy is connected."""
        return self._layout

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """`(data_parallel_size, tensor_parallel_size)`, with `"auto"` resolved; with a pipeline,
        `(pipeline_parallel_size, data_parallel_size, tensor_parallel_size)`."""
        return self.mesh_layout.shape

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 2-D mesh `("data_parallel", "tensor_parallel")` handed to `parallelize_fn`; its
        groups (`device_mesh["tensor_parallel"].get_group()`) may be passed as `group=` to the
        collectives."""
        if self._device_mesh is None:
            if not self._environment_ready:
                raise MisuseError(
                    "device_mesh was asked for before the processes were launched: use it inside run(), or"
                    " after launch()."
                )
            self._device_mesh = self._layout.build_mesh(self.root_device.type)
        return self._device_mesh

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The context-parallel group's work (cutting sequences, the ring); `None` without it."""
        if self._context is None and self._layout.context_enabled:
            self._context = ContextParallel(self.device_mesh["context_parallel"], self._context_buffers)
        return self._context

    def teardown(self, failed: bool = False) -> None:
        self._device_mesh = None  # its groups die with the process group
        self._replica_group = _UNKNOWN
        self._context = None
        self._pipelines.clear()
        super().teardown(failed)

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        mesh = self.device_mesh
        return {"num_replicas": mesh["data_parallel"].size(), "rank": mesh["data_parallel"].get_local_rank()}

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        batches = super().process_dataloader(dataloader)
        context = self.context_parallel
        return batches if context is None else context.split_batches(batches)

    # -- modules -------------------------------------------------------------------------------
    def check_precision(self, name: str) -> None:
        if self._pipeline is not None and name == "16-mixed":
            raise ConfigurationError(
                "precision='16-mixed' scales the loss before backward, but under pipeline parallelism the schedule"
                " runs the backward pass itself and cannot scale it: choose 'bf16-mixed', 'bf16-true' or '32-true'."
            )

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        self._apply_recompute(module)
        if self._pipeline is not None:
            return self._setup_pipeline(module)
        if self._parallelize_fn is None:
            raise MisuseError(
                "strategy='model_parallel' has no parallelize_fn to apply to the model: pass"
                " strategy=ModelParallelStrategy(parallelize_fn=...) with your function"
                " parallelize_fn(model, device_mesh)."
            )
        self._names_before_sharding.append(_fsdp_optimizers.NamesBeforeSharding(module))
        context = self.context_parallel
        if context is not None:
            context.split_buffers(module)
        parallelised = self._apply_parallelize_fn(module)
        if context is not None:
            context.check_gradients_averaged(parallelised, self.device_mesh[DATA_CONTEXT_DIM_NAME])
        self._sharded_modules.append(parallelised)
        return parallelised

    def _apply_parallelize_fn(self, module: nn.Module) -> nn.Module:
        """`parallelize_fn(module, device_mesh)` (`module` as it is without one), checked, and
        materialised on the device when `module` was built on the meta device."""
        on_meta = _fsdp_init.has_meta_tensors(module)
        if on_meta:
            _fsdp_init.check_reinitialisable(module)
        parallelised = module if self._parallelize_fn is None else self._parallelize_fn(module, self.device_mesh)
        if not isinstance(parallelised, nn.Module):
            raise MisuseError(
                f"parallelize_fn returned {type(parallelised).__name__}, not a module: return the"
                " parallelised model from parallelize_fn(model, device_mesh)."
            )
        _check_even_tensor_parallel_shards(parallelised)
        # Every process with tokens of its own: the data-parallel ones, each cut in context-parallel parts.
        tokens = self.device_mesh[DATA_CONTEXT_DIM_NAME if self._layout.context_enabled else "data_parallel"]
        check_experts_averaged(parallelised, tokens)
        count_loads_over(parallelised, tokens)
        if on_meta:
            _fsdp_init.materialise(parallelised, self.root_device, self.root_device, self._init_rng_state)
        return parallelised

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if not self._repoint_built_before_setup(optimizer):  # built before setup_module(): re-pointed
            self.module_of(optimizer)  # refuses an optimizer of parameters that were not set up
        return optimizer

    # -- pipeline ------------------------------------------------------------------------------
    def _setup_pipeline(self, module: nn.Module) -> nn.Module:
        """Cut `module` into stages, keep this process's, parallelise each with `parallelize_fn`
        and build their `PipelineStage`s; returns `module` holding only this process's layers."""
        assert self._pipeline is not None
        options = self._pipeline
        mesh = self.device_mesh
        pp_mesh = mesh["pipeline_parallel"]
        num_stages = options.size * options.stages_per_rank
        points = _split.split_names(module, options.split_points)
        stage_units, expanded = _split.assign_stages(module, points, num_stages)
        indexes = _pipeline.stages_on_rank(pp_mesh.get_local_rank(), options.size, options.stages_per_rank)
        parts = [_split.part(module, stage_units, index, expanded) for index in indexes]
        self._keys_before_split[id(module)] = list(module.state_dict())
        whole = meta_copy(module)  # for measure_flops: the whole model, without memory
        rehearsal = _rehearsal.Rehearsal(module, stage_units, expanded, options.microbatches)
        _split.trim(module, {unit for index in indexes for unit in stage_units[index]}, expanded)
        parts = [self._parallelize_part(part) for part in parts]
        for part, index in zip(parts, indexes):  # after parallelize_fn: its hooks (input casts) run first
            _absent.watch(part, index, stage_units[index][0])
        layout = _pipeline.StageLayout(parts, indexes, num_stages, self.root_device, pp_mesh.get_group())
        last_rank = (num_stages - 1) % options.size
        copies = [pair for part in parts for pair in _split.copies_of(part, module)]
        self._pipelines[id(module)] = PipelineForward(layout, options.schedule, options.microbatches, last_rank,
                                                      options.loss_fn, module, copies, whole, rehearsal)
        self._sharded_modules.append(module)
        return module

    def _parallelize_part(self, part: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        parallelised = self._apply_parallelize_fn(part)
        for submodule in parallelised.modules():
            if isinstance(submodule, FSDPModule):  # one all-gather per step, not one per micro-batch
                submodule.set_reshard_after_forward(False, recurse=False)
        return parallelised

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], *,
                                    precision: Precision) -> tuple[nn.Module, list[Optimizer]]:
        if self._pipeline is None:
            return super().setup_module_and_optimizers(module, optimizers, precision=precision)
        moves = [_fsdp_optimizers.capture(optimizer, module) for optimizer in optimizers]
        if any(move.state is not None for move in moves):
            raise MisuseError(
                "An optimizer that has already stepped cannot follow its model into pipeline stages: set up the"
                " model and optimizer before the first step, or load the optimizer's state after setup."
            )
        local = self.setup_module(module, precision=precision)
        parameters = dict(local.named_parameters())
        for move in moves:
            self._names_before_split[id(move.optimizer)] = move.names
            for group, names in zip(move.optimizer.param_groups, move.names):
                group["params"][:] = [parameters[name] for name in names if name in parameters]
        return local, list(optimizers)

    def forward_call(self, forward_module: nn.Module, compiled: nn.Module | None,
                     loss_fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
        pipeline = self._pipelines.get(id(forward_module))
        if pipeline is None:
            call = super().forward_call(forward_module, compiled, loss_fn)
            context = self.context_parallel
            return call if context is None else _context.RingForward(call or forward_module, context)
        if compiled is not None:
            raise MisuseError(
                "A torch.compile'd model cannot be set up under pipeline parallelism: compile each stage's"
                " blocks inside parallelize_fn instead, and pass the model uncompiled."
            )
        if loss_fn is not None:
            pipeline.loss_fn = loss_fn
        return pipeline

    def parameter_names_before_split(self, optimizer: Optimizer) -> list[list[str]] | None:
        """The names, in the whole model, of the parameters `optimizer` held per param group before
        setup cut the model into stages (`None` for an optimizer set up apart from its model)."""
        return self._names_before_split.get(id(optimizer))

    def full_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Under a pipeline, every stage's weights: each stage's first replica sends its own, gathered
        whole, to rank 0 (in the whole model's order); elsewhere as under `fsdp`."""
        keys = self._keys_before_split.get(id(module))
        if keys is None:
            return super().full_module_state_dict(module)
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        local = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        mesh = self.device_mesh
        first_replica = all(mesh[name].get_local_rank() == 0 for name in mesh.mesh_dim_names
                            if name != "pipeline_parallel")
        part = {name: value.detach().to("cpu", copy=True) for name, value in local.items()} if first_replica else {}
        parts: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(part, parts, dst=0)
        if parts is None:
            return {}
        merged = {name: value for each in parts for name, value in each.items()}
        return {name: merged[name] for name in keys if name in merged}

    def whole_module_keys(self, module: nn.Module) -> list[str] | None:
        """A pipeline stage's model: every stage's keys (a sharded checkpoint holds them all, and
        this process reads its own)."""
        return self._keys_before_split.get(id(module))

    def load_checkpoint(self, path: str, state: dict[str, Any] | None = None, strict: bool = True,
                        weights_only: bool = True, *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> dict[str, Any]:
        if self._pipeline is not None and state is not None and store_for(path).is_file(path) and not is_sharded(path):
            return _pipeline_load.load_full(self, path, state, strict, weights_only, checkpoint_io, precision)
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only,
                                       checkpoint_io=checkpoint_io, precision=precision)

    def pipeline_of(self, module: nn.Module) -> PipelineForward | None:
        """The pipeline that runs `module` (what `setup_module` returned), if any."""
        return self._pipelines.get(id(module))

    def call_module_method(self, forward_module: nn.Module, module: nn.Module, name: str,
                           *args: Any, **kwargs: Any) -> Any:
        if id(forward_module) in self._pipelines:
            raise MisuseError(
                f"model.{name}(...) cannot run under pipeline parallelism, where this process holds only some"
                " layers: call model(x, target=y) or model(x), which run through every stage."
            )
        return super().call_module_method(forward_module, module, name, *args, **kwargs)

    def backward(self, tensor: Any, module: nn.Module | None, *args: Any, precision: Precision, **kwargs: Any) -> None:
        # A loss a pipeline returned (or one computed from it, such as loss / n): the schedule ran its
        # backward pass, whose gradients are added into .grad now, scaled (see `_pipeline_backward`).
        if self._pipelines and _pipeline_backward.backward(self._pipelines.values(), tensor, self._replicas()):
            return
        if module is not None and id(module) in self._pipelines:
            raise MisuseError(
                "Under pipeline parallelism backward() takes the loss that model(x, target=y) returned since the"
                " last backward(), or a function of it such as loss / n: pass that, and compute any other loss"
                " inside loss_fn."
            )
        context = self.context_parallel
        if context is None:
            return super().backward(tensor, module, *args, precision=precision, **kwargs)
        with context.ring():
            return super().backward(tensor, module, *args, precision=precision, **kwargs)

    def _replicas(self) -> Any:
        """The data-parallel group when it has several processes (their pipelines' scales must agree);
        found once (slicing the mesh costs hundreds of Python calls)."""
        if self._replica_group is _UNKNOWN:
            data = self.device_mesh["data_parallel"]
            self._replica_group = data.get_group() if data.size() > 1 else None
        return self._replica_group

    def no_backward_sync(self, module: nn.Module) -> Any:
        if id(module) in self._pipelines:
            # Gradients accumulate at backward (see `_pipeline_backward`); the stages still reduce
            # them over the data-parallel ranks at the end of each step, as the schedule does.
            return nullcontext()
        return super().no_backward_sync(module)

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True, *, precision: Precision) -> Any:
        if self._pipeline is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite,
                                               precision=precision)
        # Each process holds some stages: one norm over every stage, combined over the pipeline.
        precision.unscale_gradients(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        error_if_nonfinite = error_if_nonfinite and not precision.skips_nonfinite_steps
        return _clip.clip_grad_norm(parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                                    across=self.device_mesh["pipeline_parallel"].get_group())

    def __repr__(self) -> str:
        dp, tp = self._requested_layout.shard, self._requested_layout.tensor
        pipeline = "" if self._pipeline is None else (
            f"pipeline_parallel_size={self._pipeline.size}, pipeline_schedule={self._pipeline.schedule_name!r},"
            f" microbatches={self._pipeline.microbatches}, ")
        context = "" if self._layout.context == 1 else f"context_parallel_size={self._layout.context}, "
        return (f"{type(self).__name__}({pipeline}data_parallel_size={dp!r}, {context}tensor_parallel_size={tp!r},"
                f" state_dict_type={self.state_dict_type!r}, timeout={self.timeout})")


def _check_even_tensor_parallel_shards(module: nn.Module) -> None:
    """Refuse a parameter that the tensor-parallel dimension splits unevenly, naming its layer."""
    from torch.distributed.tensor import DTensor, Shard

    for name, param in module.named_parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        for dim_name, placement in zip(mesh.mesh_dim_names or (), param.placements):
            if dim_name != "tensor_parallel" or not isinstance(placement, Shard):
                continue
            size = mesh[dim_name].size()
            if param.shape[placement.dim] % size:
                layer = name.rsplit(".", 1)[0] if "." in name else name
                raise MisuseError(
                    f"tensor_parallel_size={size} does not divide dimension {placement.dim} (of size"
                    f" {param.shape[placement.dim]}) of parameter '{name}' in layer '{layer}': choose a"
                    " tensor_parallel_size that divides it, or leave that layer out of the tensor-parallel plan."
                )
