"""The vocabulary of model parallelism that a user's `parallelize_fn` speaks: `MeshLayout`, the
sizes of `ModelParallelStrategy`'s device mesh, checked in one place, and the mesh built from them;
`ExpertParallel`, the style that shards a Mixture-of-Experts layer's stacked experts,
`expert_load`, the tokens its experts received, and `load_balancing_loss`, its router's auxiliary
loss over the global batch.

This module owns the sizes and the names of the mesh's dimensions; the strategy owns the processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Literal, Union

from lite_core._experts import ExpertParallel, expert_load
from lite_core._router_loss import load_balancing_loss
from lite_core.errors import ConfigurationError, MisuseError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CONTEXT_MESH_DIM_NAMES", "DATA_CONTEXT_DIM_NAME", "DATA_IN_EXPERT_DIM_NAME", "EXPERT_DATA_DIM_NAME", "EXPERT_DIM_NAME",
           "MESH_DIM_NAMES", "PIPELINE_MESH_DIM_NAMES", "ExpertParallel", "MeshLayout", "expert_load",
           "load_balancing_loss"]

#: The names of the mesh's dimensions, as Lightning Fabric names them, so a function written for
#: Fabric's `ModelParallelStrategy` works unchanged.
MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")
#: The mesh's dimensions with a pipeline (`pipeline > 1`), outermost first.
PIPELINE_MESH_DIM_NAMES = ("pipeline_parallel", "data_parallel", "tensor_parallel")
#: The mesh's dimensions with context parallelism (`context > 1`), outermost first.
CONTEXT_MESH_DIM_NAMES = ("data_parallel", "context_parallel", "tensor_parallel")
#: The flattened `data_parallel x context_parallel` dimension, over which gradients are averaged
#: (the mesh `fully_shard` takes under context parallelism).
DATA_CONTEXT_DIM_NAME = "data_context_parallel"
#: With `expert > 1`: the dimension a Mixture-of-Experts layer's experts are sharded over
#: (`ExpertParallel`), the inner `expert` processes of the data-parallel dimension.
EXPERT_DIM_NAME = "expert_parallel"
#: With `expert > 1`: the outer part of the data-parallel dimension, over which each expert shard
#: is replicated (`data_parallel` is the two flattened).
EXPERT_DATA_DIM_NAME = "expert_data_parallel"
#: With `expert > 1` and `context > 1`: the data-parallel processes inside one expert-parallel
#: group, `expert / context` of them (`expert_parallel` is this and `context_parallel` flattened).
DATA_IN_EXPERT_DIM_NAME = "data_in_expert_parallel"

#: A size: a positive integer, or (for `shard` and `tensor`) `"auto"`, resolved at launch.
Size = Union[int, Literal["auto"]]
_AUTO_SIZES = ("shard", "tensor")


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of the device mesh's dimensions, outermost first: pipeline x data (replicate x
    shard) x context x tensor, each a positive integer, checked when the layout is made.

    `shard` and `tensor` may be `"auto"` until the processes are launched: both automatic, the
    tensor dimension spans a node's devices (without a pipeline, context or expert parallelism;
    otherwise it is 1) and the data dimension takes the rest; one automatic size takes what the others leave.
    `ModelParallelStrategy(mesh=layout)` resolves them against the world size (its `mesh_layout`
    is the resolved layout). A size of 1 costs nothing: that dimension is left out of the mesh.

    Args:
        pipeline: how many processes the model's stages are spread over (1: no pipeline).
        replicate: how many copies of the data-parallel shards (1; larger is not built yet).
        shard: how many data-parallel processes the model is sharded over, each with its own data.
        context: how many processes split each sequence (1: none); not with a pipeline.
        tensor: how many processes split each layer.
        expert: how many processes a Mixture-of-Experts layer's experts are spread over (expert
            parallelism, `lite_core.parallel.ExpertParallel`); it borrows the inner processes of
            the data-parallel dimension, so it must divide `shard` and adds nothing to the world size.
            The mesh then has `"expert_data_parallel"` and `"expert_parallel"` in place of
            `"data_parallel"`, which stays reachable as their flattening. With `tensor > 1` the
            experts are whole on each process of `"tensor_parallel"`. With `context > 1` it borrows
            whole context-parallel groups and `expert / context` data-parallel processes (as
            torchtitan composes them), so it must be a multiple of `context`; the mesh is then
            `("expert_data_parallel", "data_in_expert_parallel", "context_parallel",
            "tensor_parallel")`, with `"expert_parallel"`, `"data_parallel"` and
            `"data_context_parallel"` reachable as flattenings.

    Example:
        >>> MeshLayout(pipeline=2, shard=2, tensor=2).resolve(devices=8, num_nodes=1).dim_names
        ('pipeline_parallel', 'data_parallel', 'tensor_parallel')
    """

    #: How each size is named in messages (a strategy's keywords name them otherwise).
    _LABELS: ClassVar[Mapping[str, str]] = {"pipeline": "pipeline", "replicate": "replicate", "shard": "shard",
                                            "context": "context", "tensor": "tensor", "expert": "expert"}

    pipeline: int = 1
    replicate: int = 1
    shard: Size = "auto"
    context: int = 1
    tensor: Size = "auto"
    expert: int = 1

    def __post_init__(self) -> None:
        for name in self._LABELS:
            _check_size(self._LABELS[name], getattr(self, name), auto=name in _AUTO_SIZES)
        if self.replicate > 1:
            raise ConfigurationError(
                f"{self._LABELS['replicate']}={self.replicate} is not built yet: pass replicate=1 and the whole"
                " data-parallel size as shard, whose 'data_parallel' dimension parallelize_fn may fully_shard over."
            )
        if self.context > 1 and self.pipeline > 1:
            raise ConfigurationError(
                f"{self._LABELS['context']} > 1 cannot be combined with {self._LABELS['pipeline']} > 1 yet:"
                " choose one of them."
            )
        self._check_expert()

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def is_resolved(self) -> bool:
        """Whether every size is a number (no `"auto"` left)."""
        return all(getattr(self, name) != "auto" for name in _AUTO_SIZES)

    @property
    def data(self) -> int:
        """How many groups hold distinct data: `replicate x shard` (the sampler's replicas)."""
        return self.replicate * self._number("shard")

    @property
    def world_size(self) -> int:
        """How many processes the layout needs: the product of its sizes."""
        return self.pipeline * self.data * self.context * self._number("tensor")

    def sizes(self) -> dict[str, Size]:
        """Every dimension's size by name, outermost first (`expert`, borrowed, last)."""
        return {name: getattr(self, name) for name in self._LABELS}

    # -- what is enabled -------------------------------------------------------------------------
    @property
    def pipeline_enabled(self) -> bool:
        """Whether the model is cut into stages over several processes."""
        return self.pipeline > 1

    @property
    def data_enabled(self) -> bool:
        """Whether several groups hold distinct data."""
        return self.data > 1

    @property
    def replicate_enabled(self) -> bool:
        """Whether the data-parallel shards are replicated."""
        return self.replicate > 1

    @property
    def shard_enabled(self) -> bool:
        """Whether the model may be sharded over several data-parallel processes."""
        return self._number("shard") > 1

    @property
    def context_enabled(self) -> bool:
        """Whether each sequence is split over several processes."""
        return self.context > 1

    @property
    def tensor_enabled(self) -> bool:
        """Whether each layer is split over several processes."""
        return self._number("tensor") > 1

    @property
    def expert_enabled(self) -> bool:
        """Whether experts are spread over several data-parallel processes."""
        return self.expert > 1

    # -- the mesh --------------------------------------------------------------------------------
    @property
    def dim_names(self) -> tuple[str, ...]:
        """The names of the `DeviceMesh` handed to `parallelize_fn`, outermost first:
        `("data_parallel", "tensor_parallel")`, with `"pipeline_parallel"` in front under a pipeline,
        or with `"context_parallel"` between them under context parallelism."""
        if self.context_enabled:
            if self.expert_enabled:
                return (EXPERT_DATA_DIM_NAME, DATA_IN_EXPERT_DIM_NAME, *CONTEXT_MESH_DIM_NAMES[1:])
            return CONTEXT_MESH_DIM_NAMES
        names = PIPELINE_MESH_DIM_NAMES if self.pipeline_enabled else MESH_DIM_NAMES
        if self.expert_enabled:
            names = tuple(part for name in names for part in (
                (EXPERT_DATA_DIM_NAME, EXPERT_DIM_NAME) if name == "data_parallel" else (name,)))
        return names

    @property
    def shape(self) -> tuple[int, ...]:
        """The `DeviceMesh`'s shape, in the order of `dim_names`."""
        tensor = self._number("tensor")
        if self.context_enabled:
            inside = self.expert // self.context if self.expert_enabled else 1  # data processes per expert group
            data = (self.data // inside, inside) if self.expert_enabled else (self.data,)
            return (*data, self.context, tensor)
        data = (self.data // self.expert, self.expert) if self.expert_enabled else (self.data,)
        return (self.pipeline, *data, tensor) if self.pipeline_enabled else (*data, tensor)

    def resolve(self, devices: int, num_nodes: int = 1) -> MeshLayout:
        """This layout with `"auto"` resolved for `devices` processes on each of `num_nodes` nodes;
        sizes whose product is not the number of processes are refused in one sentence."""
        world = devices * num_nodes
        fixed = self.pipeline * self.replicate * self.context
        rest = world // fixed if world % fixed == 0 else 0
        shard, tensor = self.shard, self.tensor
        if shard == "auto" and tensor == "auto":
            shard, tensor = (num_nodes, devices) if fixed == 1 and not self.expert_enabled else (rest, 1)
        elif shard == "auto":
            shard = rest // tensor if rest and rest % tensor == 0 else 0
        elif tensor == "auto":
            tensor = rest // shard if rest and rest % shard == 0 else 0
        if not shard or not tensor or fixed * shard * tensor != world:
            raise ConfigurationError(self._not_the_world_size(devices, num_nodes))
        return MeshLayout(self.pipeline, self.replicate, shard, self.context, tensor, self.expert)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The `DeviceMesh` of this (resolved) layout over the launched processes, its dimensions
        named by `dim_names`; under context parallelism with the flattened `"data_context_parallel"`,
        with `expert > 1` with `"data_parallel"` flattened from its two parts."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.dim_names)
        if self.context_enabled and self.expert_enabled:
            mesh[EXPERT_DATA_DIM_NAME, DATA_IN_EXPERT_DIM_NAME]._flatten("data_parallel")
            mesh[EXPERT_DATA_DIM_NAME, DATA_IN_EXPERT_DIM_NAME, "context_parallel"]._flatten(DATA_CONTEXT_DIM_NAME)
            mesh[DATA_IN_EXPERT_DIM_NAME, "context_parallel"]._flatten(EXPERT_DIM_NAME)
        elif self.context_enabled:
            mesh["data_parallel", "context_parallel"]._flatten(DATA_CONTEXT_DIM_NAME)
        elif self.expert_enabled:
            mesh[EXPERT_DATA_DIM_NAME, EXPERT_DIM_NAME]._flatten("data_parallel")
        return mesh

    # -- private ---------------------------------------------------------------------------------
    def _check_expert(self) -> None:
        labels = self._LABELS
        if self.expert > 1 and self.context > 1:
            self._check_expert_with_context()
            return
        shard = self.shard
        if self.expert > 1 and shard != "auto" and (self.replicate * shard) % self.expert:
            raise ConfigurationError(
                f"{labels['expert']}={self.expert} does not divide the {self.replicate * shard} data-parallel"
                f" processes it borrows from: choose an {labels['expert']} that divides {labels['shard']}."
            )

    def _check_expert_with_context(self) -> None:
        """Under context parallelism the experts borrow whole context-parallel groups and
        `expert / context` data-parallel processes."""
        labels = self._LABELS
        if self.expert % self.context:
            raise ConfigurationError(
                f"{labels['expert']}={self.expert} is not a multiple of {labels['context']}={self.context}: expert"
                " parallelism borrows whole context-parallel groups, so choose an"
                f" {labels['expert']} that {labels['context']} divides."
            )
        inside, shard = self.expert // self.context, self.shard
        if shard != "auto" and (self.replicate * shard) % inside:
            raise ConfigurationError(
                f"{labels['expert']}={self.expert} over {labels['context']}={self.context} borrows {inside}"
                f" data-parallel processes, which does not divide the {self.replicate * shard}: choose an"
                f" {labels['expert']} that makes {labels['expert']} / {labels['context']} divide {labels['shard']}."
            )

    def _number(self, name: str) -> int:
        value = getattr(self, name)
        if value == "auto":
            raise MisuseError(
                f"{self._LABELS[name]}='auto' has no size until the processes are launched: ask the resolved"
                " layout (strategy.mesh_layout, or layout.resolve(devices, num_nodes)) instead."
            )
        return int(value)

    def _not_the_world_size(self, devices: int, num_nodes: int) -> str:
        labels = self._LABELS
        # The expert dimension borrows its processes: it is no factor of the world size.
        product = " x ".join(f"{labels[f.name]}={getattr(self, f.name)!r}" for f in fields(self)
                             if f.name != "expert" and (f.name != "replicate" or self.replicate != 1))
        return (f"{product} does not make the world size {devices * num_nodes} (devices={devices} x"
                f" num_nodes={num_nodes}): choose sizes whose product is the number of processes, or leave"
                f" {labels['shard']} or {labels['tensor']} 'auto'.")


def _check_size(label: str, size: object, auto: bool) -> None:
    if (auto and size == "auto") or (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        return
    choice = "a positive integer or 'auto'" if auto else "a positive integer"
    raise ConfigurationError(f"{label}={size!r} is not valid: pass {choice}.")
