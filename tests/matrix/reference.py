"""The plain PyTorch reference: `scenario.py`'s training as plain PyTorch writes it, in one process."""

from __future__ import annotations

import contextlib
from functools import cache

import torch
from torch import nn

from scenario import (ACCUMULATE, ACCUMULATED_STEPS, GLOBAL_BATCH, SAVE_AT, SEED, STEPS, make_data, make_model,
                      make_optimizer, mse_loss)


#: The dtype each precision computes in.
DTYPES = {"64-true": torch.float64, "32-true": torch.float32, "16-true": torch.float16, "bf16-true": torch.bfloat16,
          "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


@cache
def plain_run(precision: str = "32-true", processes: int = 1) -> dict[str, object]:
    """Per-step losses, the weights after SAVE_AT steps and the final weights (name -> flat list),
    of plain PyTorch doing what `precision` means, written as a PyTorch user writes it:

    - `*-true`: the model and its inputs in that dtype (`model.to(dtype)`);
    - `bf16-mixed`: fp32 weights, the forward pass under CPU autocast in bfloat16;
    - `16-mixed`: autocast in float16 and a `GradScaler` (scale, step, update), torch's AMP recipe.

    With `processes=N`, each step's global batch is split as N data-parallel processes see it
    (rank r takes samples r, r+N, ... as a `DistributedSampler` gives them), each part's gradient
    is computed on its own and the gradients are averaged, as DDP does: the same arithmetic in the
    same precision, so low precisions compare with a tolerance far below their own error.

    Then `scenario.py`'s gradient-accumulation loop goes on from the trained weights
    (`accumulated_losses`, `accumulated_weights`).
    """
    torch.manual_seed(SEED)
    dtype = DTYPES[precision]
    mixed = precision.endswith("-mixed")
    model = make_model() if mixed else make_model().to(dtype)
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    data = make_data().tensors
    losses, at_save = [], {}
    for step in range(STEPS):
        if step == SAVE_AT:
            at_save = _flat(model)
        optimizer.zero_grad()
        step_losses = []
        for rank in range(processes):
            loss = _loss(model, data, _rows(step, rank, processes), dtype, mixed)
            (loss if scaler is None else scaler.scale(loss)).backward()  # accumulates: the ranks' sum
            step_losses.append(loss.detach())
        for parameter in model.parameters():
            parameter.grad.div_(processes)  # the average, after each part's own backward (as DDP)
        _step(optimizer, scaler)
        losses.append(_mean(step_losses))
    trained = _flat(model)
    accumulated_losses = _accumulate(model, optimizer, scaler, data, dtype, mixed, processes)
    return {"losses": losses, "at_save": at_save, "weights": trained, "initial": _initial(),
            "accumulated_losses": accumulated_losses, "accumulated_weights": _flat(model)}


def _accumulate(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                data: tuple[torch.Tensor, ...], dtype: torch.dtype, mixed: bool, processes: int) -> list[float]:
    """`scenario.py`'s accumulation loop, going on from the trained model: micro-batch i is the
    global batch i of a new epoch. Each rank adds its micro-batches' gradients up on its own (no
    all-reduce inside `no_backward_sync`); the step's last micro-batch averages the ranks' sums, as
    DDP does. Returns the per-micro-batch losses, averaged over the ranks."""
    losses = []
    for step in range(ACCUMULATED_STEPS):
        micro_losses: list[list[torch.Tensor]] = [[] for _ in range(ACCUMULATE)]
        sums = []
        for rank in range(processes):
            optimizer.zero_grad()
            for micro in range(ACCUMULATE):
                loss = _loss(model, data, _rows(step * ACCUMULATE + micro, rank, processes), dtype, mixed)
                scaled = loss / ACCUMULATE
                (scaled if scaler is None else scaler.scale(scaled)).backward()  # adds up in .grad
                micro_losses[micro].append(loss.detach())
            sums.append([parameter.grad.clone() for parameter in model.parameters()])
        for parameter, *ranks in zip(model.parameters(), *sums):
            parameter.grad = sum(ranks[1:], ranks[0]).div_(processes)
        _step(optimizer, scaler)
        optimizer.zero_grad()
        losses.extend(_mean(micro) for micro in micro_losses)
    return losses


def _loss(model: nn.Module, data: tuple[torch.Tensor, ...], rows: list[int], dtype: torch.dtype,
          mixed: bool) -> torch.Tensor:
    x_all, y_all = data
    with torch.autocast("cpu", dtype=dtype) if mixed else contextlib.nullcontext():
        out = model(x_all[rows] if mixed else x_all[rows].to(dtype))
    return mse_loss(out, y_all[rows])


def _step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()


def _mean(losses: list[torch.Tensor]) -> float:
    """The mean over the ranks, summed in rank order as the all-reduce does."""
    return (sum(losses[1:], losses[0]) / len(losses)).item()


def _rows(step: int, rank: int, processes: int) -> list[int]:
    """The samples rank `rank` of `processes` trains on at `step` (no shuffling)."""
    per_rank = GLOBAL_BATCH // processes
    return [rank + processes * (step * per_rank + i) for i in range(per_rank)]


def _initial() -> dict[str, list[float]]:
    torch.manual_seed(SEED)
    return _flat(make_model())


def _flat(model: nn.Module) -> dict[str, list[float]]:
    return {name: p.detach().float().flatten().tolist() for name, p in model.named_parameters()}
