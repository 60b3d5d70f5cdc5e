"""The model of adapters.py, shared with the plain process the test compares it with."""

from __future__ import annotations

import torch


def build(adapter_seed: int) -> torch.nn.Sequential:
    """The frozen base (seed 1) and the trained layer (`adapter_seed`), drawn from their own generators.

    On XLA's CPU harness the replicas are threads sharing torch's one global generator, and only
    their first model is built one replica at a time: the second model's draws interleaved, and
    under xla_fsdp (which keeps each replica's own shard) about 1 run in 3 resumed from other base
    weights."""
    base, adapter = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
    for layer, seed in ((base, 1), (adapter, adapter_seed)):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.uniform_(-0.25, 0.25, generator=generator)
    base.requires_grad_(False)
    return torch.nn.Sequential(base, torch.nn.Tanh(), adapter)
