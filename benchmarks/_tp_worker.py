"""Worker: per-step time of a hand-written tensor-parallel x FSDP2 loop vs the same through Lite's
`ModelParallelStrategy`, on 4 CPU processes (dp2 x tp2 over gloo), interleaved in one job.

Started by `run.py` as `python _tp_worker.py ...`. Lite starts the other 3 ranks by re-running this
script and creates the process group and the `("data_parallel", "tensor_parallel")` mesh. On that
same mesh every rank then builds, from the same weights and with the same `parallelize` function:

* `plain`   - the model parallelised by hand and a plain optimizer, `loss.backward()`.
* `lite`    - the model and optimizer set up by Lite (`setup` runs the same function).
* `control` - (with `--control`) a second hand-built model: the A/A noise floor.

Rank 0 times its steps and writes the JSON; a barrier starts every block on every rank together.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _common import MODELS, Arm, make_optimizer, per_model, run_interleaved, timer_floor_ns, write_json


def parallelize(model: nn.Module, device_mesh) -> nn.Module:
    parallelize_module(model, device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="mlp512tp", help="comma-separated names from _common.MODELS (depth 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each rank")
    parser.add_argument("--reps", default="8", help="interleaved rounds per model")
    parser.add_argument("--steps", default="10", help="timed steps per block per model")
    parser.add_argument("--warmup", default="5", help="untimed steps per arm per model")
    parser.add_argument("--control", action="store_true", help="add a second hand-built arm (A/A noise control)")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return parser.parse_args()


def build_arms(lite, model_name: str, control: bool) -> list[Arm]:
    base = MODELS[model_name].build(seed=0)
    mesh = lite.strategy.device_mesh

    def by_hand(name: str) -> Arm:
        model = parallelize(copy.deepcopy(base), mesh)
        return Arm(name, model, make_optimizer(model))

    arms = [by_hand("plain")]
    lite_model = copy.deepcopy(base)
    wrapped_model, wrapped_optimizer = lite.setup(lite_model, make_optimizer(lite_model))
    arms.append(Arm("lite", wrapped_model, wrapped_optimizer, lite.backward))
    if control:
        arms.append(by_hand("control"))
    return arms


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from lite_core import LightningLite
    from lite_core.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2)
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=4)
    lite.launch()  # rank 0 starts ranks 1-3 (this script again); every rank continues from here
    names = [n for n in args.models.split(",") if n]
    reps, steps, warmups = (per_model(v, len(names)) for v in (args.reps, args.steps, args.warmup))
    result: dict[str, object] = {"threads": torch.get_num_threads(), "world_size": dist.get_world_size(),
                                 "timer_floor_ns": timer_floor_ns(), "models": {}}
    data_rank = lite.strategy.device_mesh["data_parallel"].get_local_rank()
    for name, rep_count, step_count, warmup in zip(names, reps, steps, warmups):
        arms = build_arms(lite, name, args.control)
        batches = MODELS[name].batches(seed=1 + data_rank)  # the same batches within a tensor-parallel group
        run_interleaved(arms, batches, warmup=warmup, reps=rep_count, steps=step_count, before_block=dist.barrier)
        result["models"][name] = {  # type: ignore[index]
            "description": MODELS[name].description, "reps": rep_count, "steps_per_block": step_count,
            "block_medians_ns": {arm.name: arm.block_medians_ns for arm in arms},
        }
    if lite.is_global_zero:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
