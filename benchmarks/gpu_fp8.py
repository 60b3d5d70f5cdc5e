"""FP8 against bf16 on a GPT-style model wide enough for FP8 to pay: step time and loss curves.

    python benchmarks/gpu_fp8.py                         # on a GPU with FP8 (compute capability 8.9+)
    python benchmarks/gpu_fp8.py --device cpu --quick    # smoke run on a CPU (tiny model, FP8 emulated)

The model is gpu_bench.py's GPT-style model at width 4096 (`FP8_SIZE`: 2 blocks, 2048-token
sequences, batch 4, vocabulary 32768, about 545M parameters). At gpu_bench.py's width 768 FP8 was
30% slower than bf16 on an H200 (the casts cost more than the float8 matmuls save); at width 4096
it was 5% faster. `--quick` uses gpu_bench.py's tiny model.

Three arms from the same initial weights, each compiled with `torch.compile` as torchao expects
(not on the CPU, where FP8 is emulated): `bf16` (`LightningLite(precision="bf16-mixed")`), `fp8`
(`precision="fp8-rowwise"`) and `fp8_by_hand` (torchao's `convert_to_float8_training` and bf16
autocast written by hand, the output head left out as Lite's default does). Blocks of steps rotate
the order of the arms each round, each timed with the device synchronised; the medians are compared.
Then each arm trains `--curve-steps` steps on the same batches from the same weights, and the loss
curves are written beside the table.

Ratios: `fp8 / bf16` (FP8's speed-up, below 1 is faster) and `fp8 / fp8_by_hand` (what Lite adds
around torchao; goal <= 1.02). The Markdown table is printed and written with the raw numbers to
`--out` (`.md` and `.json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import ratio_of_medians  # noqa: E402
from gpu_bench import QUICK, GPTConfig, batches, build, lm_loss, measure_steps  # noqa: E402

Step = Callable[[torch.Tensor, torch.Tensor], float]

#: The model FP8 is measured on: its linear layers are 4096 wide (and 16384 in the MLP).
FP8_SIZE = GPTConfig(vocab=32768, width=4096, heads=32, layers=2, sequence=2048, batch=4)


def _compiled(model: nn.Module, device: torch.device) -> nn.Module:
    return torch.compile(model) if device.type == "cuda" else model


def lite_arm(model: nn.Module, device: torch.device, precision: str) -> Step:
    from lite_core import Float8Precision, LightningLite

    cuda = device.type == "cuda"
    chosen: object = precision
    if precision.startswith("fp8") and not cuda:
        chosen = Float8Precision(precision.removeprefix("fp8-"), emulate=True)
    lite = LightningLite(accelerator="cuda" if cuda else "cpu", devices=[device.index or 0] if cuda else 1,
                         precision=chosen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = lite.setup(_compiled(model, device), optimizer)

    def step(ids: torch.Tensor, target: torch.Tensor) -> float:
        ids, target = lite.to_device((ids, target))
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(ids), target)
        lite.backward(loss)
        optimizer.step()
        return loss.detach()

    return step


def by_hand_arm(model: nn.Module, device: torch.device) -> Step:
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=device.type != "cuda")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name != "head")
    model = _compiled(model.to(device), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(ids: torch.Tensor, target: torch.Tensor) -> float:
        ids, target = ids.to(device), target.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids)
        loss = lm_loss(logits, target)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


ARMS: dict[str, Callable[[nn.Module, torch.device], Step]] = {
    "bf16": lambda model, device: lite_arm(model, device, "bf16-mixed"),
    "fp8": lambda model, device: lite_arm(model, device, "fp8-rowwise"),
    "fp8_by_hand": by_hand_arm,
}


def curves(config: GPTConfig, device: torch.device, steps: int) -> dict[str, list[float]]:
    """Each arm's losses over `steps` steps from the same weights and batches."""
    data = batches(config, count=steps)
    made = {}
    for name, make in ARMS.items():
        step = make(build(config), device)
        made[name] = [float(step(*data[index])) for index in range(steps)]
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--curve-steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu_fp8")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = QUICK if args.quick else FP8_SIZE
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        print(f"fp8: skipped, {torch.cuda.get_device_name(device)} has no FP8 (compute capability below 8.9)")
        return
    rounds, steps, warmup = (3, 2, 2) if args.quick else (6, 5, 5)
    times = measure_steps(config, device, rounds, steps, warmup, makers=ARMS)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the timed arms are gone: the curves' arms get their memory
    losses = curves(config, device, args.curve_steps or (4 if args.quick else 40))
    medians = {name: statistics.median(values) for name, values in times.items()}
    rows = [("fp8 / bf16 step", ratio_of_medians(times["bf16"], times["fp8"]), "below 1: FP8 is faster"),
            ("fp8 (Lite) / fp8 by hand step", ratio_of_medians(times["fp8_by_hand"], times["fp8"]), "goal <= 1.02")]
    lines = [f"FP8 vs bf16, {device.type}, {config}", "", "| arm | median s/step | final loss |", "|---|---:|---:|"]
    lines += [f"| {name} | {medians[name]:.5f} | {losses[name][-1]:.4f} |" for name in ARMS]
    lines += ["", "| ratio | value | note |", "|---|---:|---|"]
    lines += [f"| {name} | {value:.3f} | {note} |" for name, value, note in rows]
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(table + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"times": times, "losses": losses,
                                                          "ratios": {name: value for name, value, _ in rows}}))


if __name__ == "__main__":
    main()
