"""Mutant: attribute writes on the set-up model stop at a wrapper: forward never sees them."""

from lite_core.model import _module as _set_up_model


def _kept_aside(self, name, value):
    if name.startswith("_") or name == "training":
        return super(_set_up_model.LiteModule, self).__setattr__(name, value)
    self.__dict__.setdefault("_wrapper_attributes", {})[name] = value
    return None


_set_up_model.LiteModule.__setattr__ = _kept_aside
