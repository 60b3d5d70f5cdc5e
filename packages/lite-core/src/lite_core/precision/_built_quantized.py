"""Models built with 4-bit layers under `init_module(empty_init=True)`: the base never whole in
full precision.

While the model is built, the weight and bias that an `nn.Linear` registers become meta tensors
(no memory; a weight tied to one registered before, such as a head tied to the embedding, stays
real). When the context ends, each model built in it (a module that no other module built there
holds) gets its 4-bit layers: every `nn.Linear` the filter selects becomes bitsandbytes'
`Linear4bit`, its weight a quantized placeholder built from zeros one layer at a time, and the
other `nn.Linear` layers get uninitialised memory, as `empty_init` promises. The weights loaded
afterwards (`load_state_dict` with the base's full-precision weights) are quantized as they arrive
(`_bnb._load_quantized_4bit`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from lite_core.errors import MisuseError

#: `(layer, fully qualified name) -> bool`: whether an `nn.Linear` is quantized.
ModuleFilter = Callable[[nn.Module, str], bool]


class _Built:
    """What the registration hooks saw while the model was built."""

    def __init__(self) -> None:
        self.modules: dict[int, nn.Module] = {}
        self.children: set[int] = set()
        self.real: set[int] = set()  # parameters registered in memory (a later tie keeps them)

    def parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        self.modules.setdefault(id(module), module)
        if type(module) is not nn.Linear or id(param) in self.real:
            self.real.add(id(param))
            return None
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    def submodule(self, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        self.modules.setdefault(id(module), module)
        if submodule is not None:
            self.modules.setdefault(id(submodule), submodule)
            self.children.add(id(submodule))

    def roots(self) -> list[nn.Module]:
        return [module for key, module in self.modules.items() if key not in self.children]


@contextmanager
def building_quantized(quantize: Callable[[nn.Linear], nn.Module], default_filter: Callable[[nn.Module], ModuleFilter],
                       module_filter_fn: ModuleFilter | None) -> Iterator[None]:
    """Inside, `nn.Linear` layers are built without memory; at the end, the selected ones of each
    model built become `quantize(layer)` and the others get uninitialised memory."""
    built = _Built()
    handles = [register_module_parameter_registration_hook(built.parameter),
               register_module_module_registration_hook(built.submodule)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    device = torch.get_default_device()
    for root in built.roots():
        selects = module_filter_fn or default_filter(root)
        for name, layer in list(root.named_modules()):
            if type(layer) is nn.Linear and any(p.is_meta for p in layer.parameters(recurse=False)):
                _finish(root, name, layer, selects(layer, name), quantize, device)


def _finish(root: nn.Module, name: str, layer: nn.Linear, selected: bool,
            quantize: Callable[[nn.Linear], nn.Module], device: torch.device) -> None:
    if not selected:
        layer.to_empty(device=device)
        return
    placeholder = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                            device="meta", dtype=layer.weight.dtype)
    placeholder.weight = nn.Parameter(torch.zeros(layer.weight.shape, dtype=layer.weight.dtype, device=device),
                                      requires_grad=False)
    if layer.bias is not None:
        placeholder.bias = nn.Parameter(torch.empty(layer.bias.shape, dtype=layer.bias.dtype, device=device),
                                        requires_grad=layer.bias.requires_grad)
    placeholder.train(layer.training)
    if not name:
        raise MisuseError("init_module(empty_init=True) cannot make a model that is one nn.Linear 4-bit in place:"
                          " build the layer inside a module, or let the filter leave it out.")
    quantized = quantize(placeholder)
    parent, _, attribute = name.rpartition(".")
    setattr(root.get_submodule(parent), attribute, quantized)
