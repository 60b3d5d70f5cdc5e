"""`strategy="xla"`: one model replica per XLA device, gradients averaged at each optimizer step."""

from __future__ import annotations

import os
import pickle
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map_only

from lite_core.plugins import ConfigurationError, MisuseError, Precision, reduce_on_one_process
from lite_xla.strategies import _device
from lite_xla.strategies._base import XLAStrategyBase

if TYPE_CHECKING:
    from lite_core.plugins import Accelerator, ClusterEnvironment, Launcher

_REDUCE_OPS = ("sum", "mean", "max", "min", "product")


class XLAStrategy(XLAStrategyBase):
    """Data parallel over XLA devices: torch-xla starts the replicas (`XLALauncher`).

    Each replica starts from rank 0's weights, and each optimizer step first averages the
    gradients over the replicas. On a TPU pod (`num_nodes` = its host count) every host runs the
    script; the TPU runtime joins them, and each host's `run()` returns what its first replica
    (local rank 0) returned, and `save` writes there too (see the lite-xla documentation).

    Args:
        pin_layout: passed to torch-xla's collectives (keep the default on TPUs).
        start_method: how torch-xla starts the replica processes (`"spawn"` or `"fork"`).
    """

    name = "xla"
    is_distributed = True

    def __init__(self, pin_layout: bool = True, start_method: str = "spawn") -> None:
        super().__init__()
        self.pin_layout = pin_layout
        self._start_method = start_method
        self._launcher: Launcher | None = None
        #: ids of the optimizers whose gradients were averaged for clipping before their step
        self._reduced: set[int] = set()

    def connect(self, accelerator: Accelerator, environment: ClusterEnvironment,
                device_indexes: list[int], num_nodes: int) -> None:
        super().connect(accelerator, environment, device_indexes, num_nodes)
        _check_cpu_replicas(len(device_indexes))
        if num_nodes > 1:
            from lite_xla import _pod

            _pod.check_hosts(num_nodes)

    @property
    def launcher(self) -> Launcher | None:
        if len(self.device_indexes) == 1:
            return None
        if self._launcher is None:
            from lite_xla.launcher import XLALauncher

            self._launcher = XLALauncher(self, self._start_method)
        return self._launcher

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_launcher"] = None
        return state

    # -- ranks (read from torch-xla inside a replica; never before, which would start the runtime)
    @property
    def root_device(self) -> torch.device:
        import torch_xla

        return torch_xla.device()

    @property
    def global_rank(self) -> int:
        return self._runtime("global_ordinal", 0)

    @property
    def local_rank(self) -> int:
        return self._runtime("local_ordinal", 0)

    @property
    def node_rank(self) -> int:
        """This host's index in the TPU pod (0 on one host)."""
        if self.num_nodes == 1:
            return 0
        from lite_xla import _pod

        return _pod.host_index()

    @property
    def world_size(self) -> int:
        return self._runtime("world_size", len(self.device_indexes) * self.num_nodes)

    def _runtime(self, what: str, before_launch: int) -> int:
        if not self._environment_ready:
            return before_launch
        import torch_xla.runtime as xr

        return int(getattr(xr, what)())

    # -- model and data ------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        self._broadcast_tensors([*module.parameters(), *module.buffers()], src=0)
        return module


    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Average the gradients over the replicas, unless clipping did so since the last step."""
        if id(optimizer) in self._reduced:
            self._reduced.discard(id(optimizer))
            return
        import torch_xla.core.xla_model as xm

        xm.reduce_gradients(optimizer, pin_layout=self.pin_layout)

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True, *,
                            precision: Precision) -> torch.Tensor:
        """Clip the averaged gradients (what the step applies), not this replica's own."""
        self._reduce_for_clipping(optimizer)
        norm = super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite=False,
                                           precision=precision)
        self._check_finite(norm, norm_type, error_if_nonfinite, precision)
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float, *,
                             precision: Precision) -> None:
        """Clamp the averaged gradients (what the step applies), not this replica's own."""
        self._reduce_for_clipping(optimizer)
        super().clip_gradients_value(module, optimizer, clip_val, precision=precision)

    def _check_finite(self, norm: torch.Tensor, norm_type: float, error_if_nonfinite: bool,
                      precision: Precision) -> None:
        """Raise if the gradients' total norm is not finite (unless told not to, or `precision`
        skips such steps); reading it runs the collectives behind it first, on every replica."""
        if not error_if_nonfinite or precision.skips_nonfinite_steps:
            return
        _device.cut_graph()
        if not torch.isfinite(norm).all().item():
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite, so they cannot be"
                " clipped: find the cause (e.g. a loss that overflowed) or pass error_if_nonfinite=False."
            )

    def _reduce_for_clipping(self, optimizer: Optimizer) -> None:
        if id(optimizer) not in self._reduced:
            self.reduce_gradients(optimizer)
            self._reduced.add(id(optimizer))

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- collectives -----------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if not self._environment_ready or self.world_size == 1:
            return
        import torch_xla.core.xla_model as xm

        # An all-reduce that every replica must join, waited for on the host.
        token = xm.all_reduce(xm.REDUCE_SUM, torch.zeros(1).to(self.root_device), pin_layout=self.pin_layout)
        _device.cut_graph()
        token.cpu()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._environment_ready or self.world_size == 1:
            return obj
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = self._broadcast_tensors([torch.tensor([data.numel()])], src)[0]
        padded = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.global_rank == src:
            padded = data
        received = self._broadcast_tensors([padded.to(torch.int32)], src)[0]
        return pickle.loads(received.cpu().to(torch.uint8).numpy().tobytes())

    def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        """`tensors` from replica `src`, in place where they are on the device (a masked sum).

        Whether this replica is `src` enters the graph as data, never as a constant, so that
        every replica compiles the same graph."""
        if not self._environment_ready or self.world_size == 1:
            return tensors
        import torch_xla.core.xla_model as xm

        device = self.root_device
        keep = _device.as_data(torch.tensor(float(self.global_rank == src)), device).reshape(())
        moved = [t if t.device.type == "xla" else _device.as_data(t, device).reshape(t.shape) for t in tensors]
        with torch.no_grad():
            masked = [t * keep.to(t.dtype) for t in moved]
            summed = xm.all_reduce(xm.REDUCE_SUM, masked, pin_layout=self.pin_layout)
        _device.cut_graph()
        for target, value in zip(moved, summed):
            # Swap the storage instead of `copy_`: parameters written in place before
            # torch-xla's FSDP wraps them train wrongly from the second step (torch-xla 2.9.0).
            target.data = value
        return moved

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return tree_map_only(torch.Tensor, lambda t: self._all_gather_one(t, sync_grads), tensor)

    def _all_gather_one(self, tensor: torch.Tensor, sync_grads: bool) -> torch.Tensor:
        if not self._environment_ready or self.world_size == 1:
            return tensor.unsqueeze(0).clone()  # never a view of the input, as a real gather
        import torch_xla.core.xla_model as xm

        if not sync_grads:
            # Run what is pending first: replicas whose pending work differs (an evaluation's last
            # batches differ in size) then still compile one and the same collective graph.
            _device.cut_graph()
        tensor = _device.as_data(tensor, self.root_device).reshape(1, *tensor.shape)
        if sync_grads:
            import torch_xla.core.functions as xf

            gathered = xf.all_gather(tensor, dim=0)
        else:
            gathered = xm.all_gather(tensor, dim=0, pin_layout=self.pin_layout)
        _device.cut_graph()  # a collective is a step of its own: every replica runs it now
        return gathered

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: str = "mean") -> Any:
        if reduce_op not in _REDUCE_OPS:
            raise MisuseError(f"reduce_op={reduce_op!r} is not supported: use one of {sorted(_REDUCE_OPS)}.")
        return tree_map_only(torch.Tensor, lambda t: self._all_reduce_one(t, reduce_op), tensor)

    def _all_reduce_one(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        if not self._environment_ready or self.world_size == 1:
            return reduce_on_one_process(tensor, reduce_op)
        import torch_xla.core.xla_model as xm

        ops = {"sum": xm.REDUCE_SUM, "mean": xm.REDUCE_SUM, "max": xm.REDUCE_MAX,
               "min": xm.REDUCE_MIN, "product": xm.REDUCE_MUL}
        _device.cut_graph()  # as in all_gather: one and the same collective graph on every replica
        data = _device.as_data(tensor, self.root_device)
        result = xm.all_reduce(ops[reduce_op], data, pin_layout=self.pin_layout).reshape(tensor.shape)
        if reduce_op == "mean":
            result = result / self.world_size
        _device.cut_graph()  # a collective is a step of its own: every replica runs it now
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pin_layout={self.pin_layout})"


def _check_cpu_replicas(count: int) -> None:
    """On a CPU host, `CPU_NUM_DEVICES` (if set) must agree with `devices`."""
    if count == 1 or os.environ.get("PJRT_DEVICE", "").upper() != "CPU":
        return
    given = os.environ.get("CPU_NUM_DEVICES")
    if given is not None and given != str(count):
        raise ConfigurationError(
            f"devices={count} asks for {count} XLA replicas but CPU_NUM_DEVICES={given} is set:"
            f" unset CPU_NUM_DEVICES or pass devices={given}."
        )

