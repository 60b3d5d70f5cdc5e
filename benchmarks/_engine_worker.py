"""Worker: per-step time of a hand-written sharded loop vs the same loop set up by Lite, on 2 CPU
processes, interleaved in one job.

    python _engine_worker.py --kind fsdp|deepspeed_stage_2|deepspeed_stage_3 --out FILE ...

Lite (`strategy=KIND, devices=2`) starts the second rank and creates the gloo process group; both
ranks then build, from the same weights:

* `plain`   - the engine by hand: `fully_shard(model)` (torch FSDP2) and `torch.optim.SGD`, or
  `deepspeed.initialize(model, optimizer, config)` stepped with `engine.backward` / `engine.step`
  (with the same DeepSpeed config Lite builds, so both arms do the same work).
* `lite`    - the model and optimizer set up by Lite, stepped with `lite.backward` / `optimizer.step`.
* `control` - (with `--control`) a second hand-written arm: the A/A noise floor.

All arms share the one process group; rank 0 times its steps and writes the JSON. Then both ranks
count the function calls of 10 steps of `plain` and of `lite` (`sys.setprofile`): unlike the step
time on two busy cores, that difference does not move with the machine's load.
"""

from __future__ import annotations

import argparse
import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from _common import MODELS, Arm, call_record, make_optimizer, per_model, run_interleaved, timer_floor_ns, write_json


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", required=True, choices=["fsdp", "deepspeed_stage_2", "deepspeed_stage_3"])
    parser.add_argument("--models", default="mlp1024", help="comma-separated names from _common.MODELS")
    parser.add_argument("--reps", default="10", help="interleaved rounds per model")
    parser.add_argument("--steps", default="5", help="timed steps per block per model")
    parser.add_argument("--warmup", default="2", help="untimed steps per arm per model")
    parser.add_argument("--control", action="store_true", help="add a second hand-written arm (A/A control)")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


class EngineStep:
    """What the timed loop calls `optimizer`: `step()` is the DeepSpeed engine's step (which also
    zeroes the gradients, so `zero_grad()` has nothing to do)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        self.engine.step()


def plain_fsdp(base: nn.Module, lite: Any, batch: int) -> Arm:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return Arm("plain", model, make_optimizer(model))


def plain_deepspeed(base: nn.Module, lite: Any, batch: int) -> Arm:
    import deepspeed
    from lite_deepspeed import _config

    model = copy.deepcopy(base)
    config = _config.with_batch_size(lite.strategy._full_config(), batch)  # the config Lite passes
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config)
    return Arm("plain", engine, EngineStep(engine), engine.backward)  # type: ignore[arg-type]


def build_arms(lite: Any, kind: str, model_name: str, control: bool) -> list[Arm]:
    spec = MODELS[model_name]
    base = spec.build(seed=0)
    by_hand = plain_fsdp if kind == "fsdp" else plain_deepspeed
    arms = [by_hand(base, lite, spec.batch)]
    lite_model = copy.deepcopy(base)
    wrapped_model, wrapped_optimizer = lite.setup(lite_model, make_optimizer(lite_model))
    # Each model of the run is set up by the one Lite: DeepSpeed then asks which model a loss belongs to.
    arms.append(Arm("lite", wrapped_model, wrapped_optimizer, functools.partial(lite.backward, model=wrapped_model)))
    if control:
        arm = by_hand(base, lite, spec.batch)
        arm.name = "control"
        arms.append(arm)
    return arms


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu", strategy=args.kind, devices=2)
    lite.launch()  # rank 0 starts rank 1 (this script again); both continue from here
    names = [n for n in args.models.split(",") if n]
    reps, steps, warmups = (per_model(v, len(names)) for v in (args.reps, args.steps, args.warmup))
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "world_size": dist.get_world_size(),
                              "timer_floor_ns": timer_floor_ns(), "models": {}}
    for name, rep_count, step_count, warmup in zip(names, reps, steps, warmups):
        arms = build_arms(lite, args.kind, name, args.control)
        batches = MODELS[name].batches(seed=1 + lite.global_rank)
        run_interleaved(arms, batches, warmup=warmup, reps=rep_count, steps=step_count, before_block=dist.barrier)
        result["models"][name] = {
            "description": MODELS[name].description, "reps": rep_count, "steps_per_block": step_count,
            "block_medians_ns": {arm.name: arm.block_medians_ns for arm in arms},
            **call_record(arms, batches),  # every rank counts: the steps run collectives
        }
    if lite.is_global_zero:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
