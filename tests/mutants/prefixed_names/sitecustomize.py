"""Mutant: the set-up model's `named_parameters()` carries a wrapper's prefix (`_forward_module.`)."""

from torch import nn

from lite_core.model import _module as _set_up_model


def _prefixed(self, prefix="", recurse=True, remove_duplicate=True):
    return nn.Module.named_parameters(self, "_forward_module" + ("." + prefix if prefix else ""), recurse,
                                      remove_duplicate)


_set_up_model.LiteModule.named_parameters = _prefixed
