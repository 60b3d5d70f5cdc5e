"""`bf16-mixed` means the same computation under `fsdp` as under `ddp`, and seeded dataloader
workers draw differently on every (rank, worker) pair: `tests/scripts/mixed_precision.py` on 2
real processes over gloo, once per strategy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

LR = 0.1
STEPS = 6


def make_model() -> nn.Module:  # as in mixed_precision.py
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:  # as in mixed_precision.py
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator)


@pytest.fixture(scope="module")
def job(run_script, output_of, tmp_path_factory):
    results = {}

    def get(strategy: str) -> list[dict]:
        if strategy not in results:
            out_dir = tmp_path_factory.mktemp(f"mixed-{strategy}")
            proc = run_script("mixed_precision.py", strategy, out_dir)
            assert proc.returncode == 0, output_of(proc)
            results[strategy] = [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
        return results[strategy]

    return get


def float32_losses() -> list[list[float]]:
    """Each rank's losses when the same 2-rank training runs in float32 in one plain process."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data()
    losses: list[list[float]] = [[], []]
    for _ in range(STEPS):
        optimizer.zero_grad()
        per_rank = [nn.functional.mse_loss(model(x[r::2]), y[r::2]) for r in (0, 1)]
        (sum(per_rank) / 2).backward()  # what averaging the ranks' gradients computes
        optimizer.step()
        for rank, loss in enumerate(per_rank):
            losses[rank].append(loss.item())
    return losses


def test_bf16_mixed_under_fsdp_equals_ddp(job):
    fsdp, ddp = job("fsdp"), job("ddp")
    assert [r["autocast_in_context"] for r in fsdp] == [True, True], "autocast() did nothing under fsdp"
    float32 = float32_losses()
    for rank in (0, 1):
        mixed = torch.tensor(ddp[rank]["losses"])
        # bfloat16 moves the losses by 2e-3 to 4e-3 here; the strategies agree bit for bit (measured).
        assert (mixed - torch.tensor(float32[rank])).abs().max() > 1e-4, "the run did not compute in bfloat16"
        torch.testing.assert_close(torch.tensor(fsdp[rank]["losses"]), mixed, atol=1e-6, rtol=0)


def test_seeded_workers_draw_differently_per_rank_and_worker_and_repeat(job):
    ddp = job("ddp")
    first_draws = {}  # (rank, worker) -> the first (torch, numpy, random) draw
    for rank, result in enumerate(ddp):
        first, second = result["worker_draws"]
        assert torch.equal(first, second), "the same seed_everything() gave other draws"
        for row in first.flip(0):  # the last row seen per worker is its first draw
            first_draws[(rank, int(row[0]))] = row[1:]
    assert len(first_draws) == 4
    for generator, name in enumerate(("torch", "numpy", "random")):
        values = {float(draw[generator]) for draw in first_draws.values()}
        assert len(values) == 4, f"{name} drew the same number in two (rank, worker) pairs: {first_draws}"
