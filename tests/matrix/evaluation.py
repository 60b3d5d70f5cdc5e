"""A user's evaluation loops: under every cell the numbers must be one process's.

`scenario.py` runs `evaluate_all` on its trained model at the end of every `32-true` training run
(so each such matrix cell also evaluates, at no extra process start); run as a script, this
evaluates scenario.py's seeded, untrained model under cells the matrix does not train (3 processes):

    python evaluation.py OUT_DIR

The constructor arguments come from the environment, as in `scenario.py` (`LITE_STRATEGY`,
`LITE_DEVICES`, ...). The model is evaluated with a batch of 4 on datasets that do not split
evenly over 2 or 3 processes: 11 samples; 9 samples (over 2 processes rank 1's last batch is
empty); 1 sample (every rank but 0 has nothing). Each dataset is evaluated the three ways users
write it, in one pass:

- `mnist`: the MNIST example's sum of `.item()` losses, `self.all_gather(total).sum() / len(dataset)`;
- `torchmetrics`: a `MeanSquaredError` updated per batch and `compute()`d (torchmetrics syncs over
  torch.distributed itself; under XLA, which has no torch.distributed group, it is given Lite's
  `all_gather` to sync with);
- `gathered`: `self.gather_for_metrics` of the predictions and targets per batch, the loss computed
  from the gathered tensors (and their targets, in the order they came);

and with `self.all_reduce` of each batch's row count, which every rank must call as often (a rank
that skips a batch leaves the others waiting). Each dataset starts its pass another way: under
`torch.no_grad()`, with the model in eval mode only, under `torch.inference_mode()`. Last, a
training pass over the 11 samples counts each rank's rows and batches (training keeps them equal).

Run as a script, rank 0 writes `OUT_DIR/result.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

FEATURES = 4  # scenario.py's model's inputs
#: Strategies whose matrix cells do not evaluate (`scenario.py` skips `evaluate_all`), and why;
#: test_evaluation.py reports each cell of theirs as skipped with this reason.
NOT_EVALUATED = {
    "xla_fsdp": (
        "not proven: on XLA's CPU harness (replicas as threads sharing one compilation cache) torch-xla"
        " FSDP's forward gathers parameters inside the graph that computes the batch, so replicas whose"
        " last evaluation batches differ in size compile graphs whose all-gathers get different ids, and"
        " XLA's CPU rendezvous aborts the job after 10 s"),
}
BATCH = 4
#: dataset name -> (samples, how its evaluation pass starts)
DATASETS = {"eleven": (11, "no_grad"), "nine": (9, "eval_mode"), "one": (1, "inference_mode")}


def make_data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(samples)
    x = torch.randn(samples, FEATURES, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(samples, 1, generator=generator))


def _pass_context(model: nn.Module, how: str, device: torch.device) -> Any:
    model.eval()
    if how == "no_grad" or (how == "inference_mode" and device.type == "xla"):
        return torch.no_grad()  # torch-xla 2.9 fails in inference mode ("Cannot set version_counter")
    if how == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()  # eval mode alone


def evaluate_all(lite: LightningLite, model: nn.Module) -> dict[str, Any]:
    """Every dataset evaluated by `model` (set up by `lite`), then a training pass's counts."""
    results: dict[str, Any] = {name: evaluate(lite, model, samples, how) for name, (samples, how) in DATASETS.items()}
    results["training_pass"] = training_pass(lite, model)
    sharding = lite.strategy.distributed_sampler_kwargs()
    results["replicas"] = sharding["num_replicas"] if sharding else lite.world_size  # ranks with distinct data
    return results


def evaluate(lite: LightningLite, model: nn.Module, samples: int, how: str) -> dict[str, Any]:
    loader = lite.setup_dataloaders(DataLoader(make_data(samples), batch_size=BATCH))
    group = data_parallel_group(lite)
    metric = make_metric(lite, group)
    total, rows, gathered, local_targets = 0.0, 0, [], []
    with _pass_context(model, how, lite.device):
        batches = len(loader)
        for x, y in loader:
            out = model(x)
            total += nn.functional.mse_loss(out, y, reduction="sum").item()
            metric.update(out, y)
            gathered.append(lite.gather_for_metrics({"pred": out, "target": (y,), "rows": len(y)}))
            rows += int(lite.all_reduce(len(y), group=group, reduce_op="sum").item())
            local_targets.append(y)
    preds = torch.cat([g["pred"] for g in gathered])
    targets = torch.cat([g["target"][0] for g in gathered])
    once = lite.gather_for_metrics(torch.cat(local_targets))  # collected locally, gathered once
    return {
        "mnist": (lite.all_gather(total, group=group).sum() / len(loader.dataset)).item(),
        "torchmetrics": metric.compute().item(),
        "gathered": nn.functional.mse_loss(preds, targets).item(),
        "gathered_targets": targets.flatten().tolist(),
        "gathered_once": sorted(once.flatten().tolist()),
        "gathered_rows": int(sum(g["rows"].sum() for g in gathered)),
        "all_reduced_rows": rows,
        "len": lite.all_gather(batches).tolist(),
    }


def data_parallel_group(lite: LightningLite) -> Any:
    """The group of ranks that hold distinct data: under `model_parallel` the mesh's data-parallel
    group (tensor-parallel peers hold the same samples, so a sum over the whole world counts each
    sample once per peer), else `None` (the whole world), as a user of tensor parallelism writes it."""
    mesh = getattr(lite.strategy, "device_mesh", None)
    return None if mesh is None else mesh["data_parallel"].get_group()


def make_metric(lite: LightningLite, group: Any = None) -> Any:
    from torchmetrics import MeanSquaredError  # imported by the runs that evaluate only

    if lite.world_size > 1 and not torch.distributed.is_initialized():  # XLA: torchmetrics cannot sync itself
        metric = MeanSquaredError(distributed_available_fn=lambda: True,
                                  dist_sync_fn=lambda tensor, group=None: list(lite.all_gather(tensor)))
    else:
        metric = MeanSquaredError(process_group=group)
    return metric.to(lite.device)


def training_pass(lite: LightningLite, model: nn.Module) -> dict[str, Any]:
    loader = lite.setup_dataloaders(DataLoader(make_data(11), batch_size=BATCH))
    model.train()
    rows, batches = 0, 0
    for x, _ in loader:
        rows, batches = rows + len(x), batches + 1
    return {"rows": lite.all_gather(rows).tolist(), "batches": lite.all_gather(batches).tolist()}


class Evaluation(LightningLite):
    def run(self) -> dict[str, Any]:
        import scenario

        torch.manual_seed(scenario.SEED)
        model = self.setup(scenario.make_model())
        return {"evaluation": evaluate_all(self, model), "world_size": self.world_size, "strategy": self.strategy.name}


def main() -> None:
    import scenario  # first: on XLA's CPU harness it patches torch-xla before anything runs

    out_dir = Path(sys.argv[1])
    harness = os.environ.get("LITE_XLA_CPU_HARNESS") == "1" and os.environ.get("LITE_DEVICES", "1") != "1"
    lite = Evaluation(strategy=scenario.xla_harness_strategy()) if harness else Evaluation()
    result = lite.run()
    if lite.global_rank == 0:
        (out_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
