"""One view of `ModelParallelStrategy`'s device mesh: pipeline x data (replicate x shard) x context
x tensor, outermost first, resolved from the user's sizes and checked against the world size once."""

from __future__ import annotations

from dataclasses import dataclass

from lite_core.errors import ConfigurationError

#: The names of the mesh's dimensions, as Lightning Fabric names them, so a function written for
#: Fabric's `ModelParallelStrategy` works unchanged.
MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")
#: The mesh's dimensions with a pipeline (`pipeline_parallel_size > 1`), outermost first.
PIPELINE_MESH_DIM_NAMES = ("pipeline_parallel", "data_parallel", "tensor_parallel")
#: The mesh's dimensions with context parallelism (`context_parallel_size > 1`), outermost first.
CONTEXT_MESH_DIM_NAMES = ("data_parallel", "context_parallel", "tensor_parallel")
#: The flattened `data_parallel x context_parallel` dimension, over which gradients are averaged
#: (the mesh `fully_shard` takes under context parallelism).
DATA_CONTEXT_DIM_NAME = "data_context_parallel"
#: The dimensions, outermost first, by their size attribute in `MeshLayout`.
DIMENSIONS = ("pipeline", "replicate", "shard", "context", "tensor")


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of the mesh's dimensions (each at least 1), their product the world size.

    `replicate x shard` is the data-parallel dimension (`shard` alone today); `context` splits
    each sequence. `parallelize_fn` gets the mesh of `dim_names`: `("data_parallel",
    "tensor_parallel")`, with `"pipeline_parallel"` in front under a pipeline, or with
    `"context_parallel"` between them under context parallelism.
    """

    pipeline: int = 1
    replicate: int = 1
    shard: int = 1
    context: int = 1
    tensor: int = 1

    @property
    def data(self) -> int:
        """How many groups hold distinct data: `replicate x shard`."""
        return self.replicate * self.shard

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data * self.context * self.tensor

    @property
    def dim_names(self) -> tuple[str, ...]:
        """The names of the `DeviceMesh` handed to `parallelize_fn`, outermost first."""
        if self.context > 1:
            return CONTEXT_MESH_DIM_NAMES
        return PIPELINE_MESH_DIM_NAMES if self.pipeline > 1 else MESH_DIM_NAMES

    @property
    def shape(self) -> tuple[int, ...]:
        """The `DeviceMesh`'s shape, in the order of `dim_names`."""
        if self.context > 1:
            return (self.data, self.context, self.tensor)
        sizes = (self.data, self.tensor)
        return (self.pipeline, *sizes) if self.pipeline > 1 else sizes

    def sizes(self) -> dict[str, int]:
        """Every dimension's size by name, outermost first."""
        return {name: getattr(self, name) for name in DIMENSIONS}


def resolve(pipeline: int, data: int | str, tensor: int | str, devices: int, num_nodes: int,
            context: int = 1) -> MeshLayout:
    """The layout of `pipeline x data x context x tensor` processes, `"auto"` resolved: with both
    automatic, the tensor dimension spans a node's devices (no pipeline and no context
    parallelism) or is 1 (and the data dimension takes the rest); one automatic size takes what the
    others leave. Sizes whose product is not `devices x num_nodes` are refused in one sentence."""
    world = devices * num_nodes
    requested = (data, tensor)
    fixed = pipeline * context
    rest = world // fixed if world % fixed == 0 else 0
    if data == "auto" and tensor == "auto":
        data, tensor = (num_nodes, devices) if fixed == 1 else (rest, 1)
    elif data == "auto":
        data = rest // tensor if rest and rest % tensor == 0 else 0
    elif tensor == "auto":
        tensor = rest // data if rest and rest % data == 0 else 0
    layout = MeshLayout(pipeline=pipeline, shard=int(data), context=context, tensor=int(tensor))
    if layout.world_size != world or not data or not tensor:
        raise ConfigurationError(
            f"pipeline_parallel_size={pipeline} x data_parallel_size={requested[0]!r} x"
            f" context_parallel_size={context} x tensor_parallel_size={requested[1]!r} does not make the world size {world} (devices={devices} x"
            f" num_nodes={num_nodes}): choose sizes whose product is the number of processes, or leave"
            " data_parallel_size or tensor_parallel_size 'auto'."
        )
    return layout

