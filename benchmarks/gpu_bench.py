"""Lite against plain PyTorch on a small GPT-style model in bf16: step time and peak memory.

    python benchmarks/gpu_bench.py                         # on a GPU (about a minute on an H100)
    python benchmarks/gpu_bench.py --device cpu --quick    # smoke run on a CPU (tiny model)

Step time: one process holds three copies of the model with the same initial weights, `plain`
(the model on the device, `torch.autocast(bfloat16)`, `loss.backward()`), `lite` (the same set up
by `LightningLite(precision="bf16-mixed")`, `lite.backward(loss)`) and `control` (a second plain
copy: how far noise alone moves a ratio). Blocks of steps rotate the order of the arms each round;
each block is timed with the device synchronised, and the medians over rounds are compared.

Peak memory: a fresh process per repetition (plain, lite, plain, lite, ...) trains a few steps and
reports `torch.cuda.max_memory_allocated()` (on a CPU: peak RSS).

The Markdown table is printed and written with the raw numbers to `--out` (`.md` and `.json`).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import bootstrap_ratio_ci, clean_env, ratio_of_medians  # noqa: E402


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT-style model and of one batch."""

    vocab: int
    width: int
    heads: int
    layers: int
    sequence: int
    batch: int


FULL = GPTConfig(vocab=8192, width=768, heads=12, layers=8, sequence=512, batch=16)
QUICK = GPTConfig(vocab=512, width=64, heads=4, layers=2, sequence=32, batch=4)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, transformer blocks, a final norm and a tied output layer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Embedding(config.sequence, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def batches(config: GPTConfig, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed (input, target) token batches, cycled so no data work is timed."""
    generator = torch.Generator().manual_seed(1)
    made = []
    for _ in range(count):
        ids = torch.randint(config.vocab, (config.batch, config.sequence + 1), generator=generator)
        made.append((ids[:, :-1], ids[:, 1:]))
    return made


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


# --- the arms ------------------------------------------------------------------------------------

Step = Callable[[torch.Tensor, torch.Tensor], None]


def plain_arm(model: nn.Module, device: torch.device) -> Step:
    """The step a PyTorch user writes by hand for bf16 autocast."""
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor, target: torch.Tensor) -> None:
        ids, target = ids.to(device), target.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids)
        lm_loss(logits, target).backward()
        optimizer.step()

    return step


def lite_arm(model: nn.Module, device: torch.device) -> Step:
    """The same step with Lite doing the device placement and the precision."""
    from lite_core import LightningLite

    accelerator = "cuda" if device.type == "cuda" else "cpu"
    lite = LightningLite(accelerator=accelerator, devices=[device.index or 0] if accelerator == "cuda" else 1,
                         precision="bf16-mixed")
    model, optimizer = lite.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(ids: torch.Tensor, target: torch.Tensor) -> None:
        ids, target = lite.to_device((ids, target))
        optimizer.zero_grad(set_to_none=True)
        lite.backward(lm_loss(model(ids), target))
        optimizer.step()

    return step


ARMS = {"plain": plain_arm, "lite": lite_arm, "control": plain_arm}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(step: Step, data: list[tuple[torch.Tensor, torch.Tensor]], steps: int, device: torch.device) -> float:
    """Mean seconds per step over `steps` steps, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    for index in range(steps):
        step(*data[index % len(data)])
    _sync(device)
    return (time.perf_counter() - start) / steps


def measure_steps(config: GPTConfig, device: torch.device, rounds: int, steps: int, warmup: int,
                  makers: dict[str, Callable[[nn.Module, torch.device], Step]] | None = None) -> dict[str, list[float]]:
    """Seconds per step of each arm (`ARMS` by default), from copies of one initial model, in
    blocks whose order rotates each round."""
    base = build(config)
    arms = {name: make(copy.deepcopy(base), device) for name, make in (makers or ARMS).items()}
    data = [(i.pin_memory(), t.pin_memory()) if device.type == "cuda" else (i, t) for i, t in batches(config)]
    for step in arms.values():
        time_block(step, data, warmup, device)
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            times[name].append(time_block(arms[name], data, steps, device))
    return times


# --- peak memory, one fresh process per repetition ------------------------------------------------------

def memory_worker(arm: str, config: GPTConfig, device: torch.device, steps: int) -> float:
    """Peak MiB of training `steps` steps with `arm` in this (fresh) process."""
    step = ARMS[arm](build(config), device)
    data = batches(config)
    for index in range(steps):
        step(*data[index % len(data)])
    _sync(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_memory(args: argparse.Namespace, reps: int, timeout: float) -> dict[str, list[float]]:
    peaks: dict[str, list[float]] = {"plain": [], "lite": []}
    for _ in range(reps):
        for arm in ("plain", "lite"):
            command = [sys.executable, __file__, "--memory-worker", arm, "--device", args.device]
            command += ["--quick"] if args.quick else []
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=clean_env(), check=False)
            if done.returncode != 0:
                raise RuntimeError(f"the {arm} memory worker failed:\n{done.stderr[-3000:]}")
            peaks[arm].append(float(done.stdout.strip().splitlines()[-1]))
    return peaks


# --- report ---------------------------------------------------------------------------------------------

@dataclass
class Row:
    measure: str
    unit: str
    plain: float
    lite: float
    ratio: float
    ci_low: float
    ci_high: float
    control_ratio: float | None
    samples: int


def row(measure: str, unit: str, values: dict[str, list[float]], scale: float = 1.0) -> Row:
    low, high = bootstrap_ratio_ci(values["plain"], values["lite"])
    control = ratio_of_medians(values["plain"], values["control"]) if "control" in values else None
    return Row(measure, unit, statistics.median(values["plain"]) * scale, statistics.median(values["lite"]) * scale,
               ratio_of_medians(values["plain"], values["lite"]), low, high, control, len(values["plain"]))


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def markdown(rows: list[Row], header: dict[str, Any]) -> str:
    lines = [f"Lite vs plain PyTorch, GPT-style model in bf16-mixed — {header['date']}",
             "", f"Machine: {header['machine']}  ", f"Model: {header['model']}", "",
             "| Measure | Unit | Plain | Lite | Lite / plain | 95% CI | A/A control | n |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        control = "-" if r.control_ratio is None else f"{r.control_ratio:.3f}"
        lines.append(f"| {r.measure} | {r.unit} | {r.plain:.3f} | {r.lite:.3f} | {r.ratio:.3f} |"
                     f" {r.ci_low:.3f}-{r.ci_high:.3f} | {control} | {r.samples} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny model, few repetitions (a smoke run)")
    parser.add_argument("--out", default=str(HERE / "results" / "gpu_bench"), help="output path without suffix")
    parser.add_argument("--memory-worker", choices=("plain", "lite"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = QUICK if args.quick else FULL
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.memory_worker:
        print(memory_worker(args.memory_worker, config, device, steps=3))
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: no CUDA GPU is visible; run with --device cpu for a smoke run", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)  # a CPU smoke run: one thread is far less noisy on a shared machine
    rounds, steps, warmup, memory_reps = (6, 5, 3, 1) if args.quick else (12, 20, 10, 3)
    params = sum(p.numel() for p in build(config).parameters())
    times = measure_steps(config, device, rounds, steps, warmup)
    peaks = measure_memory(args, memory_reps, timeout=300)
    rows = [row("Step time", "ms", times, scale=1e3), row("Peak memory", "MiB", peaks)]
    header = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(device),
              "model": f"{params / 1e6:.1f}M parameters, {asdict(config)}, AdamW; step = zero_grad, forward,"
                       f" cross-entropy, backward, step; {rounds} rounds x {steps} steps per arm"}
    report = markdown(rows, header)
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report)
    raw = {"header": header, "rows": [asdict(r) for r in rows], "step_seconds": times, "peak_mib": peaks}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=2))
    return 0 if all(math.isfinite(r.ratio) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
