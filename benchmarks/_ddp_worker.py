"""Worker: per-step time of plain DDP vs Lite DDP on 2 CPU processes, interleaved in one job.

Started by `run.py` as `python _ddp_worker.py ...`. Lite (`strategy="ddp", devices=2`) starts the
second rank by re-running this script and creates the gloo process group. Both ranks then build,
from the same weights:

* `plain`   - `torch.nn.parallel.DistributedDataParallel(model)` and a plain optimizer.
* `lite`    - the model and optimizer set up by Lite (Lite wraps it in the same DDP class).
* `control` - (with `--control`) a second plain DDP model: the A/A noise floor.

Both kinds of model use the one default process group, so the comparison isolates what Lite's
wrappers add to a step; process start-up is measured separately (`run.py` launch benchmark).
Rank 0 times its steps (DDP's all-reduce keeps the ranks in lock step) and writes the JSON.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from _common import MODELS, Arm, make_optimizer, per_model, run_interleaved, timer_floor_ns, write_json


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,mlp1024", help="comma-separated names from _common.MODELS")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each rank")
    parser.add_argument("--reps", default="10,6", help="interleaved rounds per model")
    parser.add_argument("--steps", default="100,5", help="timed steps per block per model")
    parser.add_argument("--warmup", default="50,2", help="untimed steps per arm per model")
    parser.add_argument("--control", action="store_true", help="add a second plain DDP arm (A/A noise control)")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return parser.parse_args()


def build_arms(lite: object, model_name: str, control: bool) -> list[Arm]:
    """Plain DDP, Lite DDP and (optionally) control arms with identical initial weights."""
    spec = MODELS[model_name]
    base = spec.build(seed=0)
    plain_model = DistributedDataParallel(copy.deepcopy(base))
    arms = [Arm("plain", plain_model, make_optimizer(plain_model))]
    lite_model = copy.deepcopy(base)
    wrapped_model, wrapped_optimizer = lite.setup(lite_model, make_optimizer(lite_model))  # type: ignore[attr-defined]
    arms.append(Arm("lite", wrapped_model, wrapped_optimizer, lite.backward))  # type: ignore[attr-defined]
    if control:
        control_model = DistributedDataParallel(copy.deepcopy(base))
        arms.append(Arm("control", control_model, make_optimizer(control_model)))
    return arms


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2)
    lite.launch()  # rank 0 starts rank 1 (this script again); both continue from here
    names = [n for n in args.models.split(",") if n]
    reps, steps, warmups = (per_model(v, len(names)) for v in (args.reps, args.steps, args.warmup))
    result: dict[str, object] = {"threads": torch.get_num_threads(), "world_size": dist.get_world_size(),
                                 "timer_floor_ns": timer_floor_ns(), "models": {}}
    for name, rep_count, step_count, warmup in zip(names, reps, steps, warmups):
        arms = build_arms(lite, name, args.control)
        batches = MODELS[name].batches(seed=1 + lite.global_rank)
        run_interleaved(arms, batches, warmup=warmup, reps=rep_count, steps=step_count, before_block=dist.barrier)
        result["models"][name] = {  # type: ignore[index]
            "description": MODELS[name].description, "reps": rep_count, "steps_per_block": step_count,
            "block_medians_ns": {arm.name: arm.block_medians_ns for arm in arms},
        }
    if lite.is_global_zero:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
