"""`ModelParallelStrategy(mesh=MeshLayout(...))` against the same job configured with the size
keywords, on 2 processes: a pipeline (PP2) and tensor parallelism (TP2), each trained once per
way of asking (`pipeline_job`'s model, loop and data).

    python mesh_layout_job.py OUT_DIR

Rank 0 writes `OUT_DIR/results.pt`: per layout and way, the device mesh's names and shape, the
initial and final full weights, the losses and norms.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pipeline_job as job
from lite_core import LightningLite
from lite_core.parallel import MeshLayout
from lite_core.strategies import ModelParallelStrategy

WORLD = 2
#: Per layout: the size keywords, and the same sizes as one `MeshLayout`.
LAYOUTS = {
    "pp2": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 1}, MeshLayout(pipeline=2, tensor=1)),
    "tp2": ({"data_parallel_size": 1, "tensor_parallel_size": 2}, MeshLayout(shard=1, tensor=2)),
}


def run(sizes: dict) -> dict:
    """`pipeline_job.train` under `ModelParallelStrategy(job.parallelize, **sizes)`."""
    pipeline = sizes.get("pipeline_parallel_size", 1) > 1 or getattr(sizes.get("mesh"), "pipeline", 1) > 1
    options = {"microbatches": 2, "split_points": ["blocks.2"]} if pipeline else {}
    strategy = ModelParallelStrategy(job.parallelize, **sizes, **options)
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=WORLD)
    lite.launch()
    mesh = lite.strategy.device_mesh
    return {**job.train(lite), "dim_names": list(mesh.mesh_dim_names), "shape": list(mesh.shape)}


def main(out: Path) -> None:
    results = {}
    for name, (keywords, layout) in LAYOUTS.items():
        results[name] = {"keywords": run(keywords), "mesh": run({"mesh": layout})}
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
