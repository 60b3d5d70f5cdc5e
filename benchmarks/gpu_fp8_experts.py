"""A Mixture of Experts' grouped products on one device: bf16 `torch._grouped_mm` against a loop over
the experts, and FP8 rowwise grouped products (`Float8Precision(experts="rowwise")`, torchao's
`_scaled_grouped_mm`) against bf16 and against torchao applied by hand (gpu_check.sh, entry 9).

    python benchmarks/gpu_fp8_experts.py --device cuda --out DIR/gpu_fp8_experts.json
    python benchmarks/gpu_fp8_experts.py --device cpu --smoke --out ...   # the bf16 arms only

Each arm trains the same stacked experts (SGD, MSE) on the same tokens, sorted by expert with
uneven counts; the arms' step times are medians of interleaved blocks (the device synchronised at
each block's ends). The FP8 arms need compute capability 9.0 (H100, H200) and say so elsewhere;
Lite's FP8 arm must give the by-hand arm's losses exactly. Prints one line starting `fp8 experts`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


class Experts(nn.Module):
    """Stacked bf16 experts; `grouped` picks `torch._grouped_mm` or a loop over the experts."""

    def __init__(self, experts: int, hidden: int, ffn: int, grouped: bool) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, ffn, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)
        self.grouped = grouped

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            hidden = torch.relu(torch._grouped_mm(tokens, self.w1.transpose(-2, -1), offs=offs))
            return torch._grouped_mm(hidden, self.w2.transpose(-2, -1), offs=offs)
        chunks = torch.split(tokens, counts.tolist())
        return torch.cat([torch.relu(c @ self.w1[e].T) @ self.w2[e].T for e, c in enumerate(chunks)])


def arms(args: argparse.Namespace, device: torch.device) -> dict[str, tuple[nn.Module, Callable, torch.optim.Optimizer]]:
    def built(grouped: bool) -> Experts:
        torch.manual_seed(0)
        return Experts(args.experts, args.hidden, args.ffn, grouped).to(device, torch.bfloat16)

    made = {}
    for name, grouped in (("loop", False), ("grouped", True)):
        model = built(grouped)
        made[name] = (model, torch.Tensor.backward, torch.optim.SGD(model.parameters(), lr=0.01))
    if fp8_skipped(device) is None:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

        from lite_core import Float8Precision, LightningLite
        from lite_core.precision.fp8 import holds_stacked_experts

        model = built(True)
        quantize_(model, Float8TrainingOpConfig(), filter_fn=holds_stacked_experts)
        made["fp8_by_hand"] = (model, torch.Tensor.backward, torch.optim.SGD(model.parameters(), lr=0.01))
        lite = LightningLite(accelerator="cuda", devices=1,
                             precision=Float8Precision(experts="rowwise", autocast_dtype=None))
        model = built(True)
        model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
        made["fp8"] = (model, lite.backward, optimizer)
    return made


def fp8_skipped(device: torch.device) -> str | None:
    """Why the FP8 arms cannot run here, or None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return "FP8 grouped products need a GPU of compute capability 9.0"
    try:
        import torchao.prototype.moe_training.config  # noqa: F401
    except ImportError:
        return "torchao's MoE training is not importable (gpu_check.sh installs torchao from $DS_WHEELS)"
    return None


def step(arm: tuple[nn.Module, Callable, torch.optim.Optimizer], batch: tuple) -> torch.Tensor:
    model, backward, optimizer = arm
    tokens, counts, target = batch
    loss = nn.functional.mse_loss(model(tokens, counts).float(), target)
    backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 rounds (tests the script)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.experts, args.hidden, args.ffn, args.tokens, rounds, steps = (
        (4, 64, 128, 256, 2, 2) if args.smoke else (8, 4096, 2048, 16384, 10, 5))
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(1)
    counts = torch.multinomial(torch.ones(args.experts), args.tokens, replacement=True, generator=generator)
    counts = torch.bincount(counts, minlength=args.experts)
    counts = (counts // 16 * 16).clamp(min=16)  # rows per group: multiples of 16, as FP8 kernels take them
    tokens = torch.randn(int(counts.sum()), args.hidden, generator=generator).to(device, torch.bfloat16)
    target = torch.randn(int(counts.sum()), args.hidden, generator=generator).to(device)
    batch = (tokens, counts.to(device) if args.device == "cuda" else counts, target)
    made = arms(args, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses = {name: [step(arm, batch).item() for _ in range(3)] for name, arm in made.items()}
    blocks: dict[str, list[float]] = {name: [] for name in made}
    for r in range(rounds):
        for name in list(made)[r % len(made):] + list(made)[:r % len(made)]:
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                step(made[name], batch)
            sync()
            blocks[name].append((time.perf_counter() - start) / steps)
    median = {name: statistics.median(values) for name, values in blocks.items()}
    result = {"device": str(device), "sizes": vars(args), "median_step_s": median, "losses": losses}
    with open(args.out, "w") as file:
        json.dump(result, file, indent=2)
    line = f"fp8 experts ({args.device}{', smoke' if args.smoke else ''}): grouped / loop {median['grouped'] / median['loop']:.3f}"
    if "fp8" in median:
        equal = "ok" if losses["fp8"] == losses["fp8_by_hand"] else f"DIFFER {losses['fp8']} {losses['fp8_by_hand']}"
        line += (f", fp8 / bf16 grouped {median['fp8'] / median['grouped']:.3f},"
                 f" Lite / by hand {median['fp8'] / median['fp8_by_hand']:.3f}, losses equal: {equal}")
        print(line)
        return 0 if equal == "ok" else 3
    print(f"{line}; fp8: skipped, {fp8_skipped(device)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
