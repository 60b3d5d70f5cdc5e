"""Helpers for the sharded-training tests: one plain PyTorch process replaying what
`tests/scripts/sharded_train.py` trained on 2 ranks (fixture `reference`)."""

from __future__ import annotations

import types
from typing import Any

import pytest

import torch
from torch import nn

LR = 0.1
MAX_NORM = 0.3


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def plain_pytorch(job: dict[str, Any], name: str, batch: int, accumulate: int,
                  clip: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """SGD over consecutive global batches of 2 ranks x `batch` samples, `accumulate` per step."""
    model = make_model()
    model.load_state_dict(job[f"{name}_initial"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = job["x"], job["y"]
    # The 2 ranks together see 2 * batch consecutive samples per micro-step.
    micro = [(x[i:i + 2 * batch], y[i:i + 2 * batch]) for i in range(0, len(x), 2 * batch)]
    norms = []
    for start in range(0, len(micro), accumulate):
        optimizer.zero_grad()
        for xb, yb in micro[start:start + accumulate]:
            nn.functional.mse_loss(model(xb), yb).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
    return model.state_dict(), norms


@pytest.fixture(scope="session")
def reference(assert_weights_match: Any) -> types.SimpleNamespace:
    """`reference.make_model()`, `reference.plain_pytorch(...)`, `reference.assert_weights_match(...)`."""
    return types.SimpleNamespace(make_model=make_model, plain_pytorch=plain_pytorch,
                                 assert_weights_match=assert_weights_match)
