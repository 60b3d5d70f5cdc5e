"""A loader's position belongs to the job, not to its shape (`tests/scripts/resume_job.py`).

A shuffled `DataLoader(data, batch_size=12, shuffle=True)` trained 2 epochs of 5 steps, checkpointed
mid-epoch (after step 3) on some number of processes and resumed on another:

- `split_batches=True`: every global step sees exactly the samples of one plain PyTorch process's
  step, and the final weights equal that process's (1e-5), uninterrupted on 2 processes and
  resumed 4 -> 2, 2 -> 1, 3 -> fsdp on 2, and with `num_workers=2` 2 -> 3;
- per-rank batches (the default): resumed on the same 2 processes it equals the uninterrupted run
  (1e-6); resumed on 3 it sees each sample of the interrupted epoch once.

Four launches in all, each running several tasks, and one task in the test's own process.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "resume_job.py"
_spec = importlib.util.spec_from_file_location("resume_job", _SCRIPT)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)  # type: ignore[union-attr]

STEPS_PER_EPOCH = job.SAMPLES // job.GLOBAL_BATCH
#: (strategy, devices, tasks) in the order they run: later starts resume what earlier ones saved.
LAUNCHES = [
    ("ddp", 4, ["s4:split:0:-:3"]),
    ("ddp", 2, ["s2:split:0:-:-", "s4to2:split:0:s4.ckpt:-", "s2i:split:0:-:3", "w2:split:2:-:3",
                "r2:rank:0:-:-", "r2i:rank:0:-:3", "r2to2:rank:0:r2i.ckpt:-"]),
    ("ddp", 3, ["w2to3:split:2:w2.ckpt:-", "r2to3:rank:0:r2i.ckpt:-", "s3:split:0:-:3"]),
    ("fsdp", 2, ["s3tofsdp2:split:0:s3.ckpt:-"]),
]
#: Run last, on one device, in the test's own process.
ONE_PROCESS = ["s2to1:split:0:s2i.ckpt:-"]


@pytest.fixture(scope="module")
def runs(run_script, output_of, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("resume")
    for strategy, devices, tasks in LAUNCHES:
        # Up to 4 processes on a small machine: give the slowest to start time to join.
        proc = run_script("resume_job.py", strategy, devices, out, *tasks, timeout=150,
                          env={"LITE_COLLECTIVE_TIMEOUT": "60"})
        assert proc.returncode == 0, output_of(proc)
    job.Job(accelerator="cpu", devices=1).run(str(out), ONE_PROCESS)
    return out


@pytest.fixture(scope="module")
def plain() -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    return job.plain_run()


def steps_of(out: Path, tag: str, devices: int) -> dict[int, list[int]]:
    """Each global step's samples: the ranks' batches in rank order."""
    per_rank = [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(devices)]
    return {int(step): [i for rank in per_rank for i in rank[step]] for step in per_rank[0]}


def assert_weights_equal(out: Path, tag: str, expected: dict[str, torch.Tensor], atol: float) -> None:
    weights = torch.load(out / f"{tag}-weights.pt", weights_only=True)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize(("before", "devices_before", "after", "devices_after"), [
    (None, 0, "s2", 2),
    ("s4", 4, "s4to2", 2),
    ("s2i", 2, "s2to1", 1),
    ("s3", 3, "s3tofsdp2", 2),
    ("w2", 2, "w2to3", 3),
])
def test_split_batches_takes_the_steps_of_one_plain_process_on_any_world_size(
        runs, plain, before, devices_before, after, devices_after) -> None:  # type: ignore[no-untyped-def]
    plain_steps, plain_weights = plain
    steps = steps_of(runs, before, devices_before) if before else {}
    assert not before or sorted(steps) == [1, 2, 3]
    steps.update(steps_of(runs, after, devices_after))
    assert sorted(steps) == list(range(1, len(plain_steps) + 1))
    for step, samples in steps.items():
        assert samples == plain_steps[step - 1], f"step {step}"
    assert_weights_equal(runs, after, plain_weights, atol=1e-5)


def test_per_rank_batches_resumed_mid_epoch_on_the_same_world_size_equal_the_uninterrupted_run(runs) -> None:
    uninterrupted = steps_of(runs, "r2", 2)
    resumed = {**steps_of(runs, "r2i", 2), **steps_of(runs, "r2to2", 2)}
    assert resumed == uninterrupted
    assert_weights_equal(runs, "r2to2", torch.load(runs / "r2-weights.pt", weights_only=True), atol=1e-6)


def test_per_rank_batches_resumed_on_more_processes_see_each_sample_of_the_epoch_once(runs) -> None:
    before, after = steps_of(runs, "r2i", 2), steps_of(runs, "r2to3", 3)
    first_epoch = [i for step in sorted(before) for i in before[step]]
    first_epoch += [i for step in sorted(after) if step <= STEPS_PER_EPOCH for i in after[step]]
    assert sorted(first_epoch) == list(range(job.SAMPLES))
    second_epoch = [i for step, samples in after.items() if step > STEPS_PER_EPOCH for i in samples]
    assert sorted(second_epoch) == list(range(job.SAMPLES))
