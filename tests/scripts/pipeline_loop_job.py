"""The user's own loop under pipeline parallelism (issue 57): gradient accumulation with
`no_backward_sync` and `backward(loss / n)`, for comparison with one plain PyTorch process.

    python pipeline_loop_job.py OUT_DIR WORLD_SIZE

On 2 processes PP2 (1F1B, 2 micro-batches); on 4, PP2 x DP2 (FSDP2). Rank 0 writes
`OUT_DIR/results.pt`. The model, data and optimizer are `pipeline_job`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pipeline_job as job
from lite_core import LightningLite

#: Batches per optimizer step, and optimizer steps.
ACCUMULATE = 2
OPTIMIZER_STEPS = 2


def accumulation(lite: LightningLite) -> dict:
    """`ACCUMULATE` batches per optimizer step, each `backward(loss / ACCUMULATE)`, the ones before
    the last inside `no_backward_sync`; clipping; the losses, norms and final weights."""
    model = job.make_model("net")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = job.make_optimizer(model)
    model, optimizer = lite.setup(model, optimizer, loss_fn=job.loss_fn)
    losses, norms = [], []
    for step in range(OPTIMIZER_STEPS):
        for index in range(ACCUMULATE):
            xb, yb = job.this_ranks_batch(lite, step * ACCUMULATE + index)
            with lite.no_backward_sync(model, enabled=index < ACCUMULATE - 1):
                loss = model(xb, target=yb)
                lite.backward(loss / ACCUMULATE)
            losses.append(lite.all_gather(loss.detach()).cpu())
        norms.append(lite.clip_gradients(model, optimizer, max_norm=job.MAX_NORM).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {"initial": initial, "final": job.full_weights(model), "losses": losses, "norms": norms}


def scale_per_replica(lite: LightningLite) -> str:
    """`backward(loss * f)` with a factor that differs between data-parallel ranks: refused on each."""
    model = lite.setup(job.make_model("net"), loss_fn=job.loss_fn)
    xb, yb = job.this_ranks_batch(lite, 0)
    loss = model(xb, target=yb)
    factor = 1 + lite.strategy.distributed_sampler_kwargs()["rank"]
    try:
        lite.backward(loss * factor)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return str(err)
    return "no error"


def main(out: Path, world: int) -> None:
    results: dict = {}
    if world == 2:
        results["accumulation_pp2"] = accumulation(job.pipeline(world, microbatches=2))
    else:
        results["accumulation_pp2xdp2"] = accumulation(job.pipeline(world, dp=2, microbatches=2))
        lite = job.pipeline(world, dp=2, microbatches=2)
        results["scale_per_replica"] = [None] * world
        dist.all_gather_object(results["scale_per_replica"], scale_per_replica(lite))
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
