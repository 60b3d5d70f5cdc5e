"""elastic_job.py's training as a Ray Train `train_loop_per_worker`: Ray starts the workers and
their process group, and Lite, which names no process counts, runs inside each worker."""

from __future__ import annotations

from typing import Any


def train(config: dict[str, Any]) -> None:
    from elastic_job import Elastic

    Elastic(accelerator="cpu", strategy="ddp").run(config["out_dir"], config["how"], 0.0)
