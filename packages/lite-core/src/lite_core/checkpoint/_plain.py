"""Plain tensors for a checkpoint, whatever wraps a model's parameters at run time.

A precision may wrap each parameter in a tensor subclass that only changes how it is computed or
communicated: torchao's float8 all-gather under FSDP2 wraps every weight shard in
`WeightWithDynamicFloat8CastTensor`. Written as it is, a checkpoint would pickle that class, and a
process without torchao (a `32-true` job, `lite consolidate`, an evaluation box) could not read it.
Such a wrapper holds exactly one tensor of its own shape and dtype (`__tensor_flatten__` names
one); the checkpoint takes that tensor. Subclasses that hold anything else (quantised data and
scales) are left as they are.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def plain_tensors(state: Any) -> Any:
    """`state` (a state dict, at any depth) with every wrapped tensor replaced by the tensor it wraps;
    a `DTensor` keeps its layout around its unwrapped local shard. Nothing is copied, and a state
    with no wrapped tensor is returned as it is (a module's state dict keeps its `_metadata`)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves, tree_map_only

    def plain(tensor: Tensor) -> Tensor:
        if isinstance(tensor, DTensor):
            inner = _wrapped(tensor._local_tensor)
            if inner is None:
                return tensor
            return DTensor.from_local(inner, tensor.device_mesh, tensor.placements, run_check=False,
                                      shape=tensor.shape, stride=tensor.stride())
        inner = _wrapped(tensor)
        return tensor if inner is None else inner

    if not any(plain(leaf) is not leaf for leaf in tree_leaves(state) if isinstance(leaf, Tensor)):
        return state
    return tree_map_only(Tensor, plain, state)


def _wrapped(tensor: Tensor) -> Tensor | None:
    """The one tensor a parameter wrapper holds, or None if `tensor` is not one."""
    if type(tensor) is Tensor or not hasattr(type(tensor), "__tensor_flatten__"):
        return None
    names, _ = tensor.__tensor_flatten__()
    if len(names) != 1:
        return None
    inner = getattr(tensor, names[0], None)
    if not isinstance(inner, Tensor) or inner.shape != tensor.shape or inner.dtype != tensor.dtype:
        return None
    deeper = _wrapped(inner)
    return inner if deeper is None else deeper
