"""Worker: per-step time of plain PyTorch vs Lite (single process, CPU), interleaved in one process.

Started by `run.py`; writes a JSON file. Arms per model:

* `plain`   - the user's model and optimizer, `loss.backward()`.
* `lite`    - a copy with the same weights, set up by `LightningLite(accelerator="cpu", devices=1)`,
              stepped through the wrapped optimizer and `lite.backward(loss)`.
* `control` - (with `--control`) a second plain copy: its ratio to `plain` shows the noise floor.

With `--loader` every arm also takes each batch from a `DataLoader` over a `TensorDataset` (batch
size of the model), the Lite arm from the loader returned by `lite.setup_dataloaders`: the step
time then includes the data path, and the difference is what the set-up dataloader adds.

With `--compile` every arm's model is `torch.compile(model)` (default inductor backend), the Lite
arm's set up as `lite.setup(torch.compile(model), ...)`: Lite's compiled step against compiled plain
PyTorch.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterable

import torch
from torch.utils.data import DataLoader, TensorDataset

from _common import MODELS, Arm, call_record, make_optimizer, per_model, run_interleaved, timer_floor_ns, write_json


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,mlp2048", help="comma-separated names from _common.MODELS")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every arm")
    parser.add_argument("--reps", default="20,6", help="interleaved rounds per model (comma-separated, per model)")
    parser.add_argument("--steps", default="300,3", help="timed steps per block (per model)")
    parser.add_argument("--warmup", default="200,2", help="untimed steps per arm before timing (per model)")
    parser.add_argument("--control", action="store_true", help="add a second plain arm (A/A noise control)")
    parser.add_argument("--loader", action="store_true", help="take every batch from a (set-up) DataLoader")
    parser.add_argument("--compile", action="store_true", help="torch.compile every arm's model")
    parser.add_argument("--out", required=True, help="JSON file to write")
    return parser.parse_args()


def make_loader(model_name: str, batches: int = 128) -> DataLoader:
    """A `DataLoader` of `batches` batches of the model's shape over a `TensorDataset`."""
    spec = MODELS[model_name]
    generator = torch.Generator().manual_seed(2)
    samples = batches * spec.batch
    dataset = TensorDataset(torch.randn(samples, spec.width, generator=generator),
                            torch.randn(samples, spec.width, generator=generator))
    return DataLoader(dataset, batch_size=spec.batch)


def build_arms(model_name: str, control: bool, loader: bool = False, compile_: bool = False) -> list[Arm]:
    """Plain, Lite and (optionally) control arms with identical initial weights; with `loader`,
    each takes its batches from its own DataLoader (Lite's set up by `setup_dataloaders`); with
    `compile_`, each arm's model is `torch.compile`d."""
    from lite_core import LightningLite

    spec = MODELS[model_name]
    new_loader = (lambda: make_loader(model_name)) if loader else (lambda: None)
    compiled = torch.compile if compile_ else (lambda model: model)
    plain_model = spec.build(seed=0)
    lite_model = copy.deepcopy(plain_model)
    arms = [Arm("plain", compiled(plain_model), make_optimizer(plain_model), loader=new_loader())]
    lite = LightningLite(accelerator="cpu", devices=1)
    wrapped_model, wrapped_optimizer = lite.setup(compiled(lite_model), make_optimizer(lite_model))
    lite_loader: Iterable | None = lite.setup_dataloaders(make_loader(model_name)) if loader else None
    arms.append(Arm("lite", wrapped_model, wrapped_optimizer, lite.backward, loader=lite_loader))
    if control:
        control_model = copy.deepcopy(plain_model)
        arms.append(Arm("control", compiled(control_model), make_optimizer(control_model), loader=new_loader()))
    return arms


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = [n for n in args.models.split(",") if n]
    reps, steps, warmups = (per_model(v, len(names)) for v in (args.reps, args.steps, args.warmup))
    result: dict[str, object] = {"threads": torch.get_num_threads(), "timer_floor_ns": timer_floor_ns(), "models": {}}
    for name, rep_count, step_count, warmup in zip(names, reps, steps, warmups):
        arms = build_arms(name, args.control, args.loader, args.compile)
        batches = MODELS[name].batches()
        run_interleaved(arms, batches, warmup=warmup, reps=rep_count, steps=step_count)
        result["models"][name] = {  # type: ignore[index]
            "description": MODELS[name].description, "reps": rep_count, "steps_per_block": step_count,
            "block_medians_ns": {arm.name: arm.block_medians_ns for arm in arms},
            **call_record(arms, batches),
        }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
