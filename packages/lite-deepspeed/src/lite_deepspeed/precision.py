"""The precision under DeepSpeed: the engine holds the weights in fp16/bf16, Lite casts the batches."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from lite_core.plugins import Precision, precision_entry


class DeepSpeedPrecision(Precision):
    """`32-true`, `16-mixed`, `bf16-mixed` or `bf16-true` carried out by DeepSpeed's fp16/bf16 modes.

    DeepSpeed keeps the model's weights in the low precision and fp32 master weights in the
    optimizer, scales the fp16 loss and skips steps that overflow. Lite casts floating-point
    inputs to the model's dtype; the `-mixed` precisions hand float32 outputs back, `bf16-true`
    leaves them in bf16.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        row = precision_entry(name)
        self.dtype: torch.dtype = row.dtype  # type: ignore[assignment]  # DeepSpeed's families: true, mixed
        self._mixed = row.family == "mixed"
        self.changes_forward = self.dtype != torch.float32

    def convert_input(self, data: Any) -> Any:
        return _cast_floating(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        if self._mixed:
            return _cast_floating(data, torch.get_default_dtype())
        return data


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, data)
