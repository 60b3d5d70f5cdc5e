"""lite-deepspeed on one GPU: ZeRO 1-3 x 32-true/bf16-mixed against plain PyTorch, and the step
time of Lite against `deepspeed.initialize` written by hand with the same config.

    python benchmarks/gpu_deepspeed.py --out RESULTS/gpu_deepspeed            # on a GPU
    python benchmarks/gpu_deepspeed.py --device cpu --quick --out /tmp/ds     # dry run on a CPU

Every Lite run makes its data inside `run()` with a CPU `torch.Generator` (under ZeRO-3 that
must stay plain torch: float32, on the CPU) and builds its model outside `init_module()`, so it
starts from the same weights as plain PyTorch from the same seed. Losses must match plain PyTorch
(32-true: 1e-4 with TF32 off; bf16-mixed: DeepSpeed keeps bf16 weights, plain uses autocast, so
5e-2). Step time: the median over timed steps (device synchronised) of Lite and of the same
config passed to `deepspeed.initialize` by hand; the ratio is reported, not judged.
Exit status 1 when a parity check fails. Writes `--out`.json and `--out`.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

STAGES = (1, 2, 3)
PRECISIONS = ("32-true", "bf16-mixed")
TOLERANCE = {"32-true": 1e-4, "bf16-mixed": 5e-2}
SEED, LR = 0, 1e-3


def make_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def make_data(steps: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)  # a CPU generator, as users write it
    return [(torch.randn(batch, width, generator=generator), torch.randn(batch, 1, generator=generator))
            for _ in range(steps)]


def timed(device: torch.device, step: Any) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start, loss)  # type: ignore[return-value]


def plain_losses(args: argparse.Namespace, precision: str) -> list[float]:
    device = torch.device(args.device)
    torch.manual_seed(SEED)
    model = make_model(args.width, args.depth).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for x, y in make_data(args.steps, args.batch, args.width):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            out = model(x.to(device))
        loss = nn.functional.mse_loss(out.float(), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def lite_run(args: argparse.Namespace, stage: int, precision: str) -> dict[str, Any]:
    from lite_core import LightningLite

    class Train(LightningLite):
        def run(self) -> dict[str, Any]:
            data = make_data(self_args.steps, self_args.batch, self_args.width)  # inside run(): plain torch
            made = sorted({(str(x.dtype), x.device.type) for x, _ in data})
            torch.manual_seed(SEED)
            model = make_model(self_args.width, self_args.depth)  # outside init_module(): plain weights
            model, optimizer = self.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
            losses, times = [], []
            for x, y in data:
                def step(x=x, y=y) -> float:
                    loss = nn.functional.mse_loss(model(self.to_device(x)).float(), self.to_device(y))
                    self.backward(loss, model=model)
                    optimizer.step()
                    optimizer.zero_grad()
                    return loss.item()
                seconds, loss = timed(self.device, step)
                losses.append(loss)
                times.append(seconds)
            return {"losses": losses, "times": times, "made_in_run": made}

    self_args = args
    lite = Train(accelerator=args.accelerator, strategy=f"deepspeed_stage_{stage}", devices=1, precision=precision)
    result = lite.run()
    result["config"] = lite.strategy._full_config() | {"train_micro_batch_size_per_gpu": args.batch}
    return result


def hand_written_times(args: argparse.Namespace, config: dict[str, Any]) -> list[float]:
    """The same training through `deepspeed.initialize` as a DeepSpeed user writes it."""
    import deepspeed

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(SEED)
    model = make_model(args.width, args.depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    dtype = torch.bfloat16 if (config.get("bf16") or {}).get("enabled") else torch.float32
    times = []
    for x, y in make_data(args.steps, args.batch, args.width):
        def step(x=x, y=y) -> float:
            loss = nn.functional.mse_loss(engine(x.to(device, dtype)).float(), y.to(device))
            engine.backward(loss)
            engine.step()
            return loss.item()
        times.append(timed(device, step)[0])
    return times


def compare(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    rows, ok = [], True
    plain = {p: plain_losses(args, p) for p in PRECISIONS}
    for stage in STAGES:
        for precision in PRECISIONS:
            lite = lite_run(args, stage, precision)
            gap = max(abs(a - b) for a, b in zip(lite["losses"], plain[precision], strict=True))
            hand = hand_written_times(args, lite["config"])
            warm = args.warmup
            lite_ms = 1e3 * statistics.median(lite["times"][warm:])
            hand_ms = 1e3 * statistics.median(hand[warm:])
            passed = math.isfinite(gap) and gap <= TOLERANCE[precision] and lite["made_in_run"] == [("torch.float32", "cpu")]
            ok &= passed
            rows.append({"stage": stage, "precision": precision, "max_loss_gap": gap, "tolerance": TOLERANCE[precision],
                         "made_in_run": lite["made_in_run"], "lite_ms": lite_ms, "hand_ms": hand_ms,
                         "ratio": lite_ms / hand_ms, "passed": passed})
            print(f"ZeRO-{stage} {precision:>10}: loss gap {gap:.2e} (<= {TOLERANCE[precision]:g})"
                  f" {'ok' if passed else 'FAIL'}; step lite {lite_ms:.2f} ms, deepspeed.initialize {hand_ms:.2f} ms"
                  f" (x{lite_ms / hand_ms:.3f})", flush=True)
    return rows, ok


def write(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    header = ("| ZeRO | precision | max loss gap vs plain | tolerance | data made in run() | Lite ms/step"
              " | deepspeed.initialize ms/step | ratio | ok |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['precision']} | {r['max_loss_gap']:.2e} | {r['tolerance']:g} | {r['made_in_run']}"
              f" | {r['lite_ms']:.2f} | {r['hand_ms']:.2f} | {r['ratio']:.3f} | {'yes' if r['passed'] else 'NO'} |"
              for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps (dry run)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_deepspeed"))
    args = parser.parse_args()
    args.accelerator = args.device
    args.width, args.depth, args.batch, args.steps, args.warmup = (
        (16, 2, 8, 6, 2) if args.quick else (1024, 8, 64, 40, 10))
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # 32-true compared with plain at 1e-4
        torch.backends.cudnn.allow_tf32 = False
    else:
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no 80-100 s JIT build
    rows, ok = compare(args)
    write(args.out, rows, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
