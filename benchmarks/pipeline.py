"""Pipeline parallelism through Lite against the same schedule written by hand with
`torch.distributed.pipelining`, on 2 processes over gloo (CPU), plus each schedule's bubble.

    python benchmarks/pipeline.py [--steps 30] [--out RESULTS.json]

Both arms run in the same two processes, interleaved step by step (Lite, by hand, Lite, ...), on
the same model, stages, micro-batches and optimizer, so a busy machine slows both alike:

- `lite`: `ModelParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="1F1B")` and the
  loop `loss = model(x, target=y)`, `backward(loss)`, `optimizer.step()`;
- `by hand`: the model cut by hand into two `PipelineStage`s and `Schedule1F1B(stage, 4,
  loss_fn)`, `schedule.step(x, target=y, losses=losses)`, the loss broadcast from the last stage
  (as Lite does, so that every rank has it), `optimizer.step()`.

An evaluation pass is measured the same way: `model(x, target=y)` under `torch.no_grad()` through
Lite (forward only, on a schedule and stages of its own) against `schedule.eval(x, target=y,
losses=losses)` by hand on a second `PipelineStage` over the same layers, with the same broadcast.

Reported (rank 0): the ratio of the median step times (goal <= 1.02) and of the evaluation
passes, and the median of the per-round ratios (paired, steadier on a busy machine), the Python calls per step of each arm (`sys.setprofile`), and for GPipe, 1F1B and interleaved 1F1B the bubble measured:
`1 - (time of this process's layers alone over the whole batch) / (pipelined step time)` (the
slower process; it includes communication), next to the textbook `(p - 1) / (v * m + p - 1)` for
p processes holding v stages each and m micro-batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lite_core import LightningLite
from lite_core.strategies import ModelParallelStrategy

WIDTH, DEPTH, BATCH, MICROBATCHES = 256, 8, 64, 4
#: The layers each Lite arm's process holds after setup (its stages).
lite_layers: list[nn.Module] = []


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def lite_arm(lite: LightningLite) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = lite.setup(model, optimizer, loss_fn=loss_fn)
    lite_layers.append(nn.Sequential(*model.children()))  # this process's layers (its stages), plain, for `bubbles`

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x, target=y)
        lite.backward(loss)
        optimizer.step()
        return loss

    def evaluate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x, target=y)

    arms[("lite", "evaluation")] = evaluate
    return step


#: The evaluation passes of each arm, by (arm, "evaluation"), filled in by the arms.
arms: dict[tuple[str, str], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def by_hand_arm(rank: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    whole = make_model()
    half = DEPTH // 2
    part = nn.Sequential(*list(whole)[rank * half:(rank + 1) * half])
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(x, target=y, losses=losses)
        loss = torch.stack(losses).mean().detach() if stage.is_last else torch.zeros(())
        dist.broadcast(loss, group_src=1)
        optimizer.step()
        return loss

    forward_only = Schedule1F1B(PipelineStage(part, rank, 2, torch.device("cpu")), MICROBATCHES, loss_fn=loss_fn)

    def evaluate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            forward_only.eval(x, target=y, losses=losses)
        loss = torch.stack(losses).mean() if stage.is_last else torch.zeros(())
        dist.broadcast(loss, group_src=1)
        return loss

    arms[("by_hand", "evaluation")] = evaluate
    return step


def calls_per_step(step: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> int:
    count = 0

    def profiler(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profiler)
    try:
        step(x, y)
    finally:
        sys.setprofile(None)
    return count


def bubbles(steps: int) -> dict[str, dict[str, float]]:
    """Per schedule (PP2, 4 micro-batches): the step time through Lite, the time this process's
    layers need alone for the whole batch (forward and backward, no pipeline; the slower process),
    the share of the step spent otherwise (bubble and communication), and the textbook bubble."""
    report = {}
    for name, per_rank in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)):
        points = [str(DEPTH * stage // (2 * per_rank)) for stage in range(1, 2 * per_rank)]
        strategy = ModelParallelStrategy(None, pipeline_parallel_size=2, pipeline_schedule=name,
                                         microbatches=MICROBATCHES, split_points=points)
        lite = LightningLite(accelerator="cpu", strategy=strategy, devices=2)
        lite.launch()
        step = lite_arm(lite)
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        local = lite_layers[-1]
        pipelined, alone = [], []
        for repeat in range(steps + 3):
            dist.barrier()
            start = time.perf_counter()
            step(x, y)
            pipelined.append(time.perf_counter() - start)
            start = time.perf_counter()
            local(x).sum().backward()
            alone.append(time.perf_counter() - start)
        step_time = statistics.median(pipelined[3:])
        busy = lite.all_reduce(torch.tensor(statistics.median(alone[3:])), reduce_op="max").item()
        report[name] = {"step_ms": 1e3 * step_time, "layers_alone_ms": 1e3 * busy,
                        "idle_share": 1 - busy / step_time,
                        "textbook_bubble": (2 - 1) / (per_rank * MICROBATCHES + 2 - 1)}
    return report


def interleaved(runs: dict[str, Callable[..., torch.Tensor]], x: torch.Tensor, y: torch.Tensor,
                steps: int) -> dict[str, list[float]]:
    """Each arm's times over `steps` rounds after 3 of warm-up, the arms alternating which goes first."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(steps + 3):
        order = list(runs.items()) if repeat % 2 else list(runs.items())[::-1]  # neither arm always first
        for name, run in order:
            dist.barrier()
            start = time.perf_counter()
            run(x, y)
            if repeat >= 3:  # warm-up: shape inference and the first p2p connections
                times[name].append(time.perf_counter() - start)
    return times


def paired(times: dict[str, list[float]]) -> float:
    """The median of the per-round ratios Lite / by hand (each round runs both arms back to back,
    so a machine that slows down for a while slows both sides of a ratio)."""
    return statistics.median(lite / hand for lite, hand in zip(times["lite"], times["by_hand"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = ModelParallelStrategy(None, pipeline_parallel_size=2, pipeline_schedule="1F1B",
                                     microbatches=MICROBATCHES, split_points=[str(DEPTH // 2)])
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=2)
    lite.launch()
    steps = {"lite": lite_arm(lite), "by_hand": by_hand_arm(lite.global_rank)}
    evaluations = {name: arms[(name, "evaluation")] for name in steps}
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)
    times = interleaved(steps, x, y, args.steps)
    eval_times = interleaved(evaluations, x, y, args.steps)
    calls = {name: calls_per_step(step, x, y) for name, step in steps.items()}
    report = {
        "step_ms_median": {name: 1e3 * statistics.median(values) for name, values in times.items()},
        "lite_over_by_hand": statistics.median(times["lite"]) / statistics.median(times["by_hand"]),
        "lite_over_by_hand_paired": paired(times),
        "evaluation_ms_median": {name: 1e3 * statistics.median(values) for name, values in eval_times.items()},
        "evaluation_lite_over_by_hand": statistics.median(eval_times["lite"]) / statistics.median(eval_times["by_hand"]),
        "evaluation_lite_over_by_hand_paired": paired(eval_times),
        "python_calls_per_step": calls,
        "python_calls_per_evaluation": {name: calls_per_step(step, x, y) for name, step in evaluations.items()},
        "bubble": bubbles(max(args.steps // 2, 5)),
    }
    if lite.is_global_zero:
        print(json.dumps(report, indent=2))
        if args.out:
            with open(args.out, "w") as file:
                json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()
