"""Shared pieces of the benchmark workers: models, batches, the timed training loop, statistics.

This module must not import `lite_core` at import time: the plain-PyTorch workers import it too,
and their memory and import numbers must not include Lite.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: Environment variables that would make a child think it is already part of a distributed job.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK",
                     "GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE")
_LAUNCH_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "LSB_", "LSF_")

Backward = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: how to build it and the shape of one batch."""

    name: str
    description: str
    width: int
    depth: int
    batch: int

    def build(self, seed: int = 0) -> nn.Module:
        """A freshly initialised model (same weights for the same seed)."""
        torch.manual_seed(seed)
        if self.depth == 1:
            return nn.Linear(self.width, self.width)
        layers: list[nn.Module] = []
        for index in range(self.depth):
            layers.append(nn.Linear(self.width, self.width))
            if index < self.depth - 1:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def batches(self, count: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`count` fixed (input, target) pairs, cycled by the loop so no data work is timed."""
        generator = torch.Generator().manual_seed(seed)
        return [(torch.randn(self.batch, self.width, generator=generator),
                 torch.randn(self.batch, self.width, generator=generator)) for _ in range(count)]


#: Models the step benchmarks can use, by name.
MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", "Linear(32,32), batch 8", width=32, depth=1, batch=8),
    "mlp2048": ModelSpec("mlp2048", "MLP 2x Linear(2048,2048)+ReLU, batch 256", width=2048, depth=2, batch=256),
    "mlp1024": ModelSpec("mlp1024", "MLP 2x Linear(1024,1024)+ReLU, batch 64/rank", width=1024, depth=2, batch=64),
    "mlp512tp": ModelSpec("mlp512tp", "MLP 2x Linear(512,512)+ReLU, colwise/rowwise over tp2, FSDP2 over dp2, batch 32/dp rank",
                          width=512, depth=2, batch=32),
}


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer every arm uses (plain SGD: cheap, so wrapper overhead is not hidden)."""
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def default_backward(loss: torch.Tensor) -> None:
    """The plain-PyTorch backward call."""
    loss.backward()


def timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                steps: int, backward: Backward = default_backward) -> list[int]:
    """Run `steps` training steps; return each step's wall time in nanoseconds.

    One step is `zero_grad`, forward, MSE loss, backward, `optimizer.step()`: exactly what a user's
    loop does, so the difference between arms is only what the wrappers add.
    """
    mse = nn.functional.mse_loss
    clock = time.perf_counter_ns
    durations = []
    count = len(batches)
    for index in range(steps):
        x, y = batches[index % count]
        start = clock()
        optimizer.zero_grad(set_to_none=True)
        loss = mse(model(x), y)
        backward(loss)
        optimizer.step()
        durations.append(clock() - start)
    return durations


def timed_loader_steps(model: nn.Module, optimizer: torch.optim.Optimizer,
                       loader: Iterable[tuple[torch.Tensor, torch.Tensor]], steps: int,
                       backward: Backward = default_backward) -> list[int]:
    """Like `timed_steps`, but each timed step also takes its batch from `loader` (`next()` on
    its iterator). A step that finds the epoch over is not counted: the loader starts again."""
    mse = nn.functional.mse_loss
    clock = time.perf_counter_ns
    durations: list[int] = []
    batches = iter(loader)
    while len(durations) < steps:
        start = clock()
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        optimizer.zero_grad(set_to_none=True)
        loss = mse(model(x), y)
        backward(loss)
        optimizer.step()
        durations.append(clock() - start)
    return durations


@dataclass
class Arm:
    """One variant of the loop (plain, lite, or the plain A/A control) and its timings.

    With a `loader`, each step takes its batch from it (the data path is timed too); otherwise
    from the fixed batches given to `run_interleaved`.
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    backward: Backward = default_backward
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        self.block_medians_ns: list[float] = []

    def steps(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], count: int) -> list[int]:
        """Run `count` timed steps of this arm; return each step's wall time in nanoseconds."""
        if self.loader is not None:
            return timed_loader_steps(self.model, self.optimizer, self.loader, count, self.backward)
        return timed_steps(self.model, self.optimizer, batches, count, self.backward)


def run_interleaved(arms: Sequence[Arm], batches: Sequence[tuple[torch.Tensor, torch.Tensor]], warmup: int,
                    reps: int, steps: int, before_block: Callable[[], None] | None = None) -> None:
    """Warm every arm up, then run `reps` rounds of one `steps`-long block per arm.

    The order of the arms rotates every round (A B C, B C A, C A B, ...) so slow drifts of the
    machine (other jobs, frequency changes) fall on every arm alike. The garbage collector is off
    inside a block and run between blocks (after `gc.freeze()`, so a collection only walks objects
    made since the warm-up and takes microseconds, not the ~0.1 s a full pass over torch's objects
    takes). Each block's median step time is kept per arm.
    """
    for arm in arms:
        arm.steps(batches, warmup)
    gc.collect()
    gc.freeze()
    for rep in range(reps):
        shift = rep % len(arms)
        for arm in list(arms[shift:]) + list(arms[:shift]):
            gc.collect()
            if before_block is not None:
                before_block()
            gc.disable()
            try:
                durations = arm.steps(batches, steps)
            finally:
                gc.enable()
            arm.block_medians_ns.append(statistics.median(durations))


def count_calls(arm: Arm, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], steps: int = 10) -> tuple[float, Counter[str]]:
    """Function calls made from Python per training step (Python functions and C functions alike).

    Deterministic, unlike wall time: the difference between the plain and the Lite arm is exactly
    the extra Python work the wrappers do per step, whatever the machine's load.
    """
    arm.steps(batches, 2)  # lazy initialisation out of the way
    counts: Counter[str] = Counter()

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts[f"{_short_path(frame.f_code.co_filename)}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            counts[f"<C>:{getattr(arg, '__name__', repr(arg))}"] += 1

    sys.setprofile(profiler)
    try:
        arm.steps(batches, steps)
    finally:
        sys.setprofile(None)
    harness = (":timed_steps", ":timed_loader_steps", ":steps")
    for name in [n for n in counts if n.endswith(harness) or "perf_counter_ns" in n]:
        del counts[name]  # the harness itself, identical in every arm
    return sum(counts.values()) / steps, counts


def call_record(arms: Sequence[Arm], batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                steps: int = 10) -> dict[str, Any]:
    """The JSON entries of `count_calls` for the first two arms (plain, lite): calls per step of
    each, and the extra calls of one Lite step by function."""
    calls = {arm.name: count_calls(arm, batches, steps) for arm in arms[:2]}
    extra = calls["lite"][1] - calls["plain"][1]
    return {"calls_per_step": {name: per_step for name, (per_step, _) in calls.items()},
            "extra_lite_calls_per_step": {name: count / steps for name, count in extra.most_common()}}


def _short_path(filename: str) -> str:
    for marker in ("lite_core/", "torch/"):
        if marker in filename:
            return marker + filename.split(marker, 1)[1]
    return os.path.basename(filename)


def per_model(values: str, count: int) -> list[int]:
    """Parse a comma-separated list of ints, repeating the last value to `count` entries."""
    parsed = [int(v) for v in values.split(",") if v]
    return (parsed + parsed[-1:] * count)[:count]


def timer_floor_ns(samples: int = 20001) -> float:
    """Median of back-to-back `perf_counter_ns()` differences: the timer's own cost per reading."""
    clock = time.perf_counter_ns
    values = []
    for _ in range(samples):
        start = clock()
        values.append(clock() - start)
    return float(statistics.median(values))


def max_rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def clean_env(**extra: str) -> dict[str, str]:
    """A copy of `os.environ` without launcher/scheduler variables, plus `extra`."""
    env = {key: value for key, value in os.environ.items()
           if key not in _LAUNCH_VARIABLES and not key.startswith(_LAUNCH_PREFIXES)}
    env.update(extra)
    return env


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2)
    os.replace(tmp, path)


# -- statistics ---------------------------------------------------------------------------------
def ratio_of_medians(plain: Sequence[float], lite: Sequence[float]) -> float:
    """median(lite) / median(plain)."""
    return statistics.median(lite) / statistics.median(plain)


def bootstrap_ratio_ci(plain: Sequence[float], lite: Sequence[float], resamples: int = 2000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `ratio_of_medians`, resampling repetitions as pairs.

    `plain[i]` and `lite[i]` were measured next to each other, so a repetition is resampled as a
    pair and machine drift between repetitions does not widen the interval artificially. With very
    few repetitions (the `--quick` run) the interval is only a rough guide.
    """
    if len(plain) != len(lite) or len(plain) < 2:
        value = ratio_of_medians(plain, lite)
        return value, value
    rng = random.Random(seed)
    count = len(plain)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(count) for _ in range(count)]
        ratios.append(statistics.median(lite[i] for i in picks) / statistics.median(plain[i] for i in picks))
    ratios.sort()
    tail = (1.0 - level) / 2.0
    low = ratios[int(tail * (resamples - 1))]
    high = ratios[int((1.0 - tail) * (resamples - 1))]
    return low, high
