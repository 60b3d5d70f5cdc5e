"""The user's own loop under pipeline parallelism (issue 57): gradient accumulation with
`no_backward_sync` and `backward(loss / n)`, and a GPT-style model whose forward has no guards for
the layers a stage does not hold; for comparison with one plain PyTorch process.

    python pipeline_loop_job.py OUT_DIR WORLD_SIZE

On 2 processes PP2 (1F1B, 2 micro-batches); on 4, PP2 x DP2 (FSDP2) and PP2 x TP2. Rank 0 writes
`OUT_DIR/results.pt`. The model, data and optimizer are `pipeline_job`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

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


VOCAB, SEQUENCE = 16, 4


class GPT(nn.Module):
    """Token embedding, blocks, final norm and head, with a forward that has no guards: a stage
    runs it with the layers it does not hold handing their input on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, job.WIDTH)
        self.blocks = nn.ModuleList([job.Block() for _ in range(4)])
        self.norm = nn.LayerNorm(job.WIDTH)
        self.head = nn.Linear(job.WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return (torch.randint(VOCAB, (3 * job.GLOBAL_BATCH, SEQUENCE), generator=generator),
            torch.randint(VOCAB, (3 * job.GLOBAL_BATCH, SEQUENCE), generator=generator))


def unguarded(lite: LightningLite) -> dict:
    """Two steps of the GPT (cut without split points: embed, blocks.0-1 | blocks.2-3, norm, head),
    then an evaluation of the third batch under `torch.no_grad()`."""
    model = make_gpt()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = job.make_optimizer(model)
    model, optimizer = lite.setup(model, optimizer, loss_fn=gpt_loss)
    tokens, targets = gpt_data()
    losses = []
    for step in range(3):
        batch = slice(step * job.GLOBAL_BATCH, (step + 1) * job.GLOBAL_BATCH)
        xb, yb = lite.to_device(tokens[batch]), lite.to_device(targets[batch])
        if step == 2:
            with torch.no_grad():
                evaluation = (model(xb, target=yb), model(xb))
            break
        optimizer.zero_grad()
        loss = model(xb, target=yb)
        lite.backward(loss)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())
    return {"initial": initial, "final": job.full_weights(model), "losses": losses,
            "eval_loss": evaluation[0].cpu(), "eval_output": evaluation[1].cpu()}


def flops(world: int) -> dict:
    """`measure_flops` of the GPT before and after `setup` on each stage (stage 1 holds neither the
    embedding its input goes to nor anything before it), and what the monitor takes from it."""
    from lite_core import ThroughputMonitor, measure_flops

    lite = job.pipeline(world, microbatches=2, split_points=None)
    tokens = gpt_data()[0][:job.GLOBAL_BATCH]
    before = measure_flops(make_gpt(), tokens)
    model = lite.setup(make_gpt(), loss_fn=gpt_loss)
    after = measure_flops(model, lite.to_device(tokens))
    after_on_device = measure_flops(model, lite.to_device(tokens), on_meta=False)
    monitor = ThroughputMonitor(lite, flops_per_step=after, peak_flops=1e12, log_every_n_steps=0)
    gathered = lite.all_gather(torch.tensor([before, after, after_on_device, monitor._flops_per_step],
                                            dtype=torch.float64))
    return {"counts": gathered.cpu(), "devices": monitor.devices}


class ScaledGPT(GPT):
    """The GPT with `embed(tokens) * 2` unguarded: stage 1, which does not hold the embedding,
    cannot hand its input on for it."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * 2.0
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def contract_breach(world: int) -> list[str]:
    """Each rank's error from a training call of `ScaledGPT`, which breaks the remaining contract on
    stage 1 only: without the check on every stage before the schedule, stage 0 waited for stage
    1's gradients until the collective timeout."""
    lite = job.pipeline(world, microbatches=2, split_points=None)
    model = ScaledGPT()
    model, optimizer = lite.setup(model, job.make_optimizer(model)[0], loss_fn=gpt_loss)
    tokens, targets = gpt_data()
    try:
        model(lite.to_device(tokens[:job.GLOBAL_BATCH]), target=lite.to_device(targets[:job.GLOBAL_BATCH]))
        message = "no error"
    except Exception as err:  # noqa: BLE001 - the message is the result
        message = f"{type(err).__name__}: {err}"
    messages: list = [None] * world
    dist.all_gather_object(messages, message)
    return messages


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
        results["unguarded_pp2"] = unguarded(job.pipeline(world, microbatches=2, split_points=None))
        results["flops"] = flops(world)
        results["contract"] = contract_breach(world)
    else:
        results["accumulation_pp2xdp2"] = accumulation(job.pipeline(world, dp=2, microbatches=2))
        results["accumulation_pp2xtp2"] = accumulation(job.pipeline(world, dp=1, tp=2, microbatches=2))
        lite = job.pipeline(world, dp=2, microbatches=2)
        results["scale_per_replica"] = [None] * world
        dist.all_gather_object(results["scale_per_replica"], scale_per_replica(lite))
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
