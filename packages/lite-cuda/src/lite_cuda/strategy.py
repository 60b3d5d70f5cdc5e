"""`strategy="dp"`: one process drives several GPUs with `torch.nn.DataParallel`."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn import DataParallel

from lite_core.plugins import Precision, PrecisionSupport, Strategy


class DataParallelStrategy(Strategy):
    """Replicates the model on every GPU of `devices` at each forward and splits the batch.

    The batch goes to the first GPU and outputs are gathered there; gradients are summed onto the
    first GPU's parameters. Prefer `ddp` for speed; `dp` needs no extra processes.
    """

    name = "dp"
    supported_accelerators = frozenset({"cuda"})
    # DataParallel copies every weight to each GPU at each forward (`replicate`), as plain tensors:
    # bitsandbytes' quantized weights lose their quantization state on the way.
    precision_support = PrecisionSupport(families=frozenset({"true", "mixed", "fp8"}))
    drives_devices_from_one_process = True

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        assert self.accelerator is not None
        devices = [self.accelerator.get_device(index) for index in self.device_indexes]
        if precision.changes_forward:
            # DataParallel runs each replica in its own thread, where an autocast dtype set in
            # the caller's thread does not apply: enter the job's precision's context in each replica.
            module = _InPrecision(module, precision)
        return DataParallel(module, device_ids=devices, output_device=devices[0])


class _InPrecision(nn.Module):
    """Runs the wrapped module's forward inside the precision's forward context."""

    def __init__(self, module: nn.Module, precision: Any) -> None:
        super().__init__()
        self.module = module
        self._precision = precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._precision.forward_context():
            return self.module(*args, **kwargs)
