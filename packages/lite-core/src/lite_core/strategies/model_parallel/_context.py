"""Context parallelism for `ModelParallelStrategy(context_parallel_size=C)`, on torch's own pieces
(`torch.distributed.tensor.experimental._context_parallel`): the set-up loader's batches and the
buffers the user names are cut along the sequence with torch's head-tail load balancer, and while
the set-up model runs forward and backward `F.scaled_dot_product_attention` is torch's ring
attention over the context-parallel group. Lite adds only what its loop needs: where the split
happens, when the ring is on, and the refusals (a mask the ring cannot honour, a CPU, gradients
that no one averages over the group)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lite_core._user_frame import warn_user
from lite_core.errors import ConfigurationError, MisuseError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The dimension of a batch tensor (at least 2-D) that holds the sequence: `(batch, sequence, ...)`.
SEQUENCE_DIM = 1
#: The sequence dimension of the query, key and value `scaled_dot_product_attention` takes:
#: `(batch, heads, sequence, head_dim)`.
_ATTENTION_SEQUENCE_DIM = 2


def check_buffers(buffers: Mapping[str, int] | None) -> dict[str, int]:
    """`context_parallel_buffers` as a dict of buffer name to sequence dimension, checked."""
    if buffers is None:
        return {}
    if not isinstance(buffers, Mapping) or not all(
            isinstance(name, str) and isinstance(dim, int) and not isinstance(dim, bool) for name, dim in buffers.items()):
        raise ConfigurationError(
            f"context_parallel_buffers={buffers!r} is not valid: pass a dict from a buffer's name in the model to"
            " its sequence dimension, such as {'rope.freqs': 0}."
        )
    return dict(buffers)


class ContextParallel:
    """The context-parallel group's share of the work: cutting sequences and running the ring."""

    def __init__(self, mesh: DeviceMesh, buffers: Mapping[str, int]) -> None:
        self.mesh = mesh  # the 1-D "context_parallel" mesh
        self.buffers = dict(buffers)
        self._ring_depth = 0
        self._warned_no_attention = False

    @property
    def size(self) -> int:
        return self.mesh.size()

    # -- sequences -------------------------------------------------------------------------------
    def split(self, tensors: list[torch.Tensor], dims: list[int]) -> list[torch.Tensor]:
        """This rank's part of each tensor along its sequence dimension, after torch's head-tail
        load balancing (rank r holds chunks r and 2C-1-r of 2C, so causal attention costs every
        rank the same). Every tensor must have one sequence length, divisible by `2 x C`."""
        from torch.distributed.tensor.experimental._context_parallel import (
            _context_parallel_shard,
            _HeadTailLoadBalancer,
        )

        lengths = {tensor.shape[dim] for tensor, dim in zip(tensors, dims)}
        length = next(iter(lengths))
        if len(lengths) > 1 or length % (2 * self.size):
            raise MisuseError(
                f"context_parallel_size={self.size} cuts sequences into {2 * self.size} equal chunks, but got sequence"
                f" lengths {sorted(lengths)} (dimension {dims[0]}): make every sequence in a batch one length"
                f" divisible by {2 * self.size} (pad it), or name the buffer's sequence dimension rightly."
            )
        balancer = _HeadTailLoadBalancer(length, self.size, tensors[0].device)
        return [part.contiguous() for part in _context_parallel_shard(self.mesh, tensors, dims, balancer)]

    def split_batch(self, batch: Any) -> Any:
        """`batch` with every tensor of at least two dimensions cut along dimension 1 (its
        sequence), inside dicts, lists and tuples; other values as they are."""
        leaves, spec = tree_flatten(batch)
        where = [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2]
        if not where:
            return batch
        parts = self.split([leaves[index] for index in where], [SEQUENCE_DIM] * len(where))
        for index, part in zip(where, parts):
            leaves[index] = part
        return tree_unflatten(leaves, spec)

    def split_batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        for batch in batches:
            yield self.split_batch(batch)

    def split_buffers(self, module: nn.Module) -> None:
        """Replace each named buffer of `module` by this rank's part of it (before `parallelize_fn`)."""
        persistent = set(module.state_dict(keep_vars=True))
        for name, dim in self.buffers.items():
            owner_name, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            buffer = owner._buffers.get(attribute) if attribute in owner._buffers else None
            if buffer is None or name in persistent or buffer.is_meta:
                raise MisuseError(
                    f"context_parallel_buffers names '{name}', which is not a non-persistent buffer of the model with"
                    " values: name buffers registered with register_buffer(..., persistent=False), built outside"
                    " init_module(empty_init=True)."
                )
            (owner._buffers[attribute],) = self.split([buffer], [dim])

    # -- attention -------------------------------------------------------------------------------
    @contextmanager
    def ring(self, forward: bool = False) -> Iterator[None]:
        """While inside, `F.scaled_dot_product_attention` runs torch's ring attention over the
        context-parallel group (for the forward pass and for the backward pass of what it built);
        a `forward` pass that never called it is warned about once."""
        if self._ring_depth:
            self._ring_depth += 1
            try:
                yield
            finally:
                self._ring_depth -= 1
            return
        import torch.nn.functional as F
        from torch.distributed.tensor.experimental._context_parallel import _attention

        original = F.scaled_dot_product_attention
        ring = _RingAttention(original, self.mesh)
        F.scaled_dot_product_attention = ring  # type: ignore[assignment]
        _attention._cp_options.enable_load_balance = True  # the batches were cut head-tail
        _attention._enable_cp_dtensor_dispatcher()
        self._ring_depth = 1
        try:
            yield
        finally:
            self._ring_depth = 0
            _attention._disable_cp_dtensor_dispatcher()
            F.scaled_dot_product_attention = original  # type: ignore[assignment]
        if forward and not ring.calls and not self._warned_no_attention:
            self._warned_no_attention = True
            warn_user(
                "Under context parallelism the model's forward made no call to torch.nn.functional."
                "scaled_dot_product_attention, so any attention it computes sees only this rank's part of each sequence:"
                " call the function through the module (F.scaled_dot_product_attention), not a name imported from it."
            )

    def check_gradients_averaged(self, module: nn.Module, data_context: DeviceMesh) -> None:
        """Refuse a parameter whose gradient no one averages over the data-parallel and
        context-parallel ranks (`data_context`): each rank saw only part of every sequence, so its
        gradient is only part of the step."""
        from torch.distributed.tensor import DTensor

        ranks = set(data_context.mesh.flatten().tolist())
        for name, parameter in module.named_parameters():
            if isinstance(parameter, DTensor) and ranks <= set(parameter.device_mesh.mesh.flatten().tolist()):
                continue
            raise MisuseError(
                f"Parameter '{name}' is not sharded over the data-parallel and context-parallel ranks, so their"
                " gradients, each from part of every sequence, would never be averaged: in parallelize_fn apply"
                " fully_shard(model, mesh=device_mesh['data_context_parallel'])."
            )


class _RingAttention:
    """`F.scaled_dot_product_attention` as torch's context parallelism runs it: query, key and value
    become `DTensor`s sharded on the sequence, which torch's dispatcher sends round the ring."""

    def __init__(self, original: Any, mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.experimental._context_parallel import _ContextParallel

        self._original = original
        self._mesh = mesh
        self.calls = 0
        self._style = _ContextParallel(seq_dim=_ATTENTION_SEQUENCE_DIM,
                                       attention_type=_ContextParallel.AttentionType.SDPA)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if attn_mask is not None:
            raise MisuseError(
                "scaled_dot_product_attention got an attn_mask, which torch's ring attention under context parallelism"
                " cannot honour (it knows only is_causal=True or no mask): drop the mask and pass is_causal=True, or set"
                " context_parallel_size=1."
            )
        if query.device.type == "cpu":
            raise MisuseError(
                "context_parallel_size > 1 runs scaled_dot_product_attention as torch's ring attention, which has no CPU"
                " kernel (torch shards only the CUDA flash, efficient and cuDNN kernels): run on GPUs, or set"
                " context_parallel_size=1."
            )
        self.calls += 1
        args_in, kwargs_in = self._style.sdpa_input_fn(None, (query, key, value, *args), kwargs, self._mesh)
        output = self._original(*args_in, **kwargs_in)
        return self._style.sdpa_output_fn(None, None, output, self._mesh)


class RingForward:
    """The set-up model's forward call with torch's ring attention on around it."""

    def __init__(self, call: Any, context: ContextParallel) -> None:
        self._call = call
        self._context = context

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._context.ring(forward=True):
            return self._call(*args, **kwargs)
