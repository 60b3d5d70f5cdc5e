"""Model parallelism: the user's own `parallelize_fn(model, device_mesh)` on a 2-D device mesh named
`("data_parallel", "tensor_parallel")`, typically torch's `parallelize_module` (tensor parallel)
within a node and `fully_shard` (FSDP2) over the data-parallel dimension."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from torch import nn
from torch.optim import Optimizer

from lite_core.errors import ConfigurationError, MisuseError
from lite_core.strategies import _fsdp_init, _fsdp_optimizers
from lite_core.strategies.fsdp import FSDPStrategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lite_core.accelerators.accelerator import Accelerator
    from lite_core.environments.environment import ClusterEnvironment

#: The names of the mesh's dimensions, as Lightning Fabric names them, so a function written for
#: Fabric's `ModelParallelStrategy` works unchanged.
MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")


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
        parallelize_fn: `parallelize_fn(model, device_mesh) -> model`.
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

    Example:
        >>> def parallelize(model, device_mesh):  # doctest: +SKIP
        ...     plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        ...     parallelize_module(model, device_mesh["tensor_parallel"], plan)
        ...     return fully_shard(model, mesh=device_mesh["data_parallel"])
        >>> LightningLite(strategy=ModelParallelStrategy(parallelize), devices=4)  # doctest: +SKIP
    """

    name = "model_parallel"
    # Float16 autocast needs a gradient scaler that understands gradients on a device mesh.
    supported_precisions = frozenset({"32-true", "bf16-mixed", "bf16-true"})

    def __init__(self, parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
                 data_parallel_size: int | str = "auto", tensor_parallel_size: int | str = "auto",
                 save_distributed_checkpoint: bool = True, timeout: float | timedelta | None = None,
                 process_group_backend: str | None = None) -> None:
        super().__init__(state_dict_type="sharded" if save_distributed_checkpoint else "full",
                         timeout=timeout, process_group_backend=process_group_backend)
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ConfigurationError(
                f"parallelize_fn={parallelize_fn!r} is not callable: pass a function"
                " parallelize_fn(model, device_mesh) that returns the parallelised model."
            )
        self._parallelize_fn = parallelize_fn
        self._requested_sizes = (_check_size("data_parallel_size", data_parallel_size),
                                 _check_size("tensor_parallel_size", tensor_parallel_size))
        self._device_mesh: DeviceMesh | None = None

    # -- layout --------------------------------------------------------------------------------
    def connect(self, accelerator: Accelerator, environment: ClusterEnvironment,
                device_indexes: list[int], num_nodes: int) -> None:
        super().connect(accelerator, environment, device_indexes, num_nodes)
        _ = self.mesh_shape  # refuses sizes that do not multiply to the world size, at construction

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """`(data_parallel_size, tensor_parallel_size)`, with `"auto"` resolved."""
        per_node = len(self.device_indexes)
        world = per_node * self.num_nodes
        dp, tp = self._requested_sizes
        if dp == "auto" and tp == "auto":
            dp, tp = self.num_nodes, per_node
        elif dp == "auto":
            dp = world // tp if world % tp == 0 else 0
        elif tp == "auto":
            tp = world // dp if world % dp == 0 else 0
        if dp * tp != world:
            raise ConfigurationError(
                f"data_parallel_size={self._requested_sizes[0]!r} x tensor_parallel_size={self._requested_sizes[1]!r}"
                f" does not make the world size {world} (devices={per_node} x num_nodes={self.num_nodes}): choose"
                " sizes whose product is the number of processes, or leave one of them 'auto'."
            )
        return int(dp), int(tp)

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
            from torch.distributed.device_mesh import init_device_mesh

            self._device_mesh = init_device_mesh(self.root_device.type, self.mesh_shape,
                                                 mesh_dim_names=MESH_DIM_NAMES)
        return self._device_mesh

    def teardown(self, failed: bool = False) -> None:
        self._device_mesh = None  # its groups die with the process group
        super().teardown(failed)

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        mesh = self.device_mesh
        return {"num_replicas": mesh["data_parallel"].size(), "rank": mesh["data_parallel"].get_local_rank()}

    # -- modules -------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._parallelize_fn is None:
            raise MisuseError(
                "strategy='model_parallel' has no parallelize_fn to apply to the model: pass"
                " strategy=ModelParallelStrategy(parallelize_fn=...) with your function"
                " parallelize_fn(model, device_mesh)."
            )
        on_meta = _fsdp_init.has_meta_tensors(module)
        if on_meta:
            _fsdp_init.check_reinitialisable(module)
        self._names_before_sharding.append(_fsdp_optimizers.NamesBeforeSharding(module))
        parallelised = self._parallelize_fn(module, self.device_mesh)
        if not isinstance(parallelised, nn.Module):
            raise MisuseError(
                f"parallelize_fn returned {type(parallelised).__name__}, not a module: return the"
                " parallelised model from parallelize_fn(model, device_mesh)."
            )
        _check_even_tensor_parallel_shards(parallelised)
        if on_meta:
            _fsdp_init.materialise(parallelised, self.root_device, self.root_device, self._init_rng_state)
        self._sharded_modules.append(parallelised)
        return parallelised

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if not self._repoint_built_before_setup(optimizer):  # built before setup_module(): re-pointed
            self.module_of(optimizer)  # refuses an optimizer of parameters that were not set up
        return optimizer

    def __repr__(self) -> str:
        dp, tp = self._requested_sizes
        return (f"{type(self).__name__}(data_parallel_size={dp!r}, tensor_parallel_size={tp!r},"
                f" state_dict_type={self.state_dict_type!r}, timeout={self.timeout})")


def _check_size(name: str, size: int | str) -> int | str:
    if size == "auto" or (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        return size
    raise ConfigurationError(f"{name}={size!r} is not valid: pass a positive integer or 'auto'.")


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
