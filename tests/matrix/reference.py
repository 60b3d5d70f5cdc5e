"""The plain PyTorch reference: `scenario.py`'s training in one process, on the whole global batch."""

from __future__ import annotations

import contextlib
from functools import cache

import torch
from torch import nn
from torch.utils.data import DataLoader

from scenario import GLOBAL_BATCH, SAVE_AT, SEED, make_data, make_model, make_optimizer


@cache
def plain_run(precision: str = "32-true") -> dict[str, object]:
    """Per-step losses, the weights after SAVE_AT steps and the final weights (name -> flat list).

    `bf16-mixed` runs the forward pass under CPU autocast in bfloat16, as Lite's precision does;
    every other precision is compared with fp32 training.
    """
    torch.manual_seed(SEED)
    model = make_model()
    optimizer = make_optimizer(model)
    autocast = precision == "bf16-mixed"
    losses, at_save = [], {}
    for step, (x, y) in enumerate(DataLoader(make_data(), batch_size=GLOBAL_BATCH)):
        if step == SAVE_AT:
            at_save = _flat(model)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "at_save": at_save, "weights": _flat(model), "initial": _initial()}


def _initial() -> dict[str, list[float]]:
    torch.manual_seed(SEED)
    return _flat(make_model())


def _flat(model: nn.Module) -> dict[str, list[float]]:
    return {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
