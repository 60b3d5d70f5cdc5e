"""Mutant: autocast does nothing (mixed precision silently computes in float32)."""

import contextlib

import torch


class _NoAutocast(contextlib.nullcontext):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def __call__(self, fn):
        return fn


torch.autocast = _NoAutocast
torch.amp.autocast = _NoAutocast
