"""Streams keep the job's position (`tests/scripts/stream_job.py`): an `IterableDataset` that knows
nothing of ranks or workers, trained 2 epochs of 5 global steps against one plain PyTorch process
reading the same stream (1e-5 on the weights, every global step's sample ids equal):

- under `ddp` on 2, uninterrupted: a shuffle-buffered stream with `split_batches=True` and with
  per-rank batches (each sample once per epoch across the ranks); under `fsdp` on 2 with
  `split_batches=True`, uninterrupted, and checkpointed mid-epoch (sharded) then resumed under
  `ddp` on 3; under `model_parallel` (data 2 x tensor 2) uninterrupted, both ranks of a
  tensor-parallel group with the same batch, and checkpointed mid-epoch (sharded) then resumed in
  the same layout with 2 workers and under `ddp` on 3;
- checkpointed mid-epoch (after step 3) on 2 with `split_batches=True` and resumed on 1 (the
  shuffled stream with `num_workers` 2 -> 0, a packed token stream 0 -> 2) and on 3 (2 -> 2);
- per-rank batches checkpointed on 2 and resumed on 3: each sample once per epoch;
- an evaluation pass over a stream of 9 samples on 2 and 3 (the last round leaving a process
  without a sample): `gather_for_metrics` collects each sample once.

Four launches (ddp on 2, fsdp on 2, data 2 x tensor 2 on 4, ddp on 3), each running one task or
more, and one task in the test's own process.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]  # a hang guard: a launch takes ~20 s

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stream_job.py"
_spec = importlib.util.spec_from_file_location("stream_job", _SCRIPT)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)  # type: ignore[union-attr]

STEPS_PER_EPOCH = job.SAMPLES // job.GLOBAL_BATCH
#: (strategy, devices, tasks), in the order they run: later starts resume what earlier ones saved.
LAUNCHES = [
    ("ddp", 2, ["rs2:rows:split:0:-:-", "rr2:rows:rank:0:-:-", "rs2i:rows:split:2:-:3", "ps2i:packed:split:0:-:3",
                "rr2i:rows:rank:0:-:3", "e2:evaluate:9"]),
    ("fsdp", 2, ["fs2:rows:split:0:-:-", "fs2i:rows:split:2:-:3"]),  # sharded checkpoint, resumed under ddp on 3
    # data parallel 2 x tensor parallel 2: uninterrupted, and checkpointed mid-epoch (sharded), then
    # resumed in the same layout with 2 workers, and under ddp on 3
    ("model_parallel", 4, ["ms4:rows:split:0:-:-", "ms4i:rows:split:0:-:3", "ms4r:rows:split:2:ms4i.ckpt:-"]),
    ("ddp", 3, ["rs2to3:rows:split:2:rs2i.ckpt:-", "rr2to3:rows:rank:0:rr2i.ckpt:-", "fs2to3:rows:split:0:fs2i.ckpt:-",
                "ms4to3:rows:split:0:ms4i.ckpt:-", "e3:evaluate:9"]),
]
#: Run last, on one device, in the test's own process.
ONE_PROCESS = ["rs2to1:rows:split:0:rs2i.ckpt:-", "ps2to1:packed:split:2:ps2i.ckpt:-"]


@pytest.fixture(scope="module")
def runs(run_script, output_of, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("streams")
    for strategy, devices, tasks in LAUNCHES:
        proc = run_script("stream_job.py", strategy, devices, out, *tasks, timeout=150,
                          env={"LITE_COLLECTIVE_TIMEOUT": "60"})
        assert proc.returncode == 0, output_of(proc)
    job.Job(accelerator="cpu", devices=1).run(str(out), ONE_PROCESS)
    return out


@pytest.fixture(scope="module")
def plain() -> dict[str, tuple[list[list[int]], dict[str, torch.Tensor]]]:
    return {data: job.plain_run(data) for data in ("rows", "packed")}


def steps_of(out: Path, tag: str, devices: int, tensor_parallel: int = 1) -> dict[int, list[int]]:
    """Each global step's sample ids: the data-parallel ranks' batches in rank order (the ranks of
    one tensor-parallel group, `tensor_parallel` consecutive ranks, must hold the same batch)."""
    per_rank = [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(devices)]
    for rank in range(devices):
        assert per_rank[rank] == per_rank[rank - rank % tensor_parallel], f"rank {rank} left its group's batch"
    per_rank = per_rank[::tensor_parallel]
    return {int(step): [i for rank in per_rank for i in rank[step]] for step in per_rank[0]}


def assert_weights_equal(out: Path, tag: str, expected: dict[str, torch.Tensor]) -> None:
    weights = torch.load(out / f"{tag}-weights.pt", weights_only=True)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize(("data", "before", "devices_before", "after", "devices_after"), [
    ("rows", None, 0, "rs2", 2),
    ("rows", None, 0, "rr2", 2),  # per-rank batches of 6 on 2: rank r takes the r-th half of each 12
    ("rows", "rs2i", 2, "rs2to1", 1),
    ("rows", "rs2i", 2, "rs2to3", 3),
    ("packed", "ps2i", 2, "ps2to1", 1),
    ("rows", None, 0, "fs2", 2),  # under fsdp
    ("rows", "fs2i", 2, "fs2to3", 3),  # fsdp's sharded checkpoint with 2 workers, resumed under ddp on 3 with none
])
def test_a_stream_takes_the_steps_of_one_plain_process_reading_it(
        runs, plain, data, before, devices_before, after, devices_after) -> None:  # type: ignore[no-untyped-def]
    plain_steps, plain_weights = plain[data]
    steps = steps_of(runs, before, devices_before) if before else {}
    assert not before or sorted(steps) == [1, 2, 3]
    steps.update(steps_of(runs, after, devices_after))
    assert sorted(steps) == list(range(1, len(plain_steps) + 1))
    for step, samples in steps.items():
        assert samples == plain_steps[step - 1], f"step {step}"
    assert_weights_equal(runs, after, plain_weights)


@pytest.mark.parametrize(("before", "after", "devices_after", "tensor_parallel_after"), [
    (None, "ms4", 4, 2),
    ("ms4i", "ms4r", 4, 2),  # resumed in the same layout, with 2 workers instead of none
    ("ms4i", "ms4to3", 3, 1),  # resumed under ddp on 3
])
def test_a_stream_under_data_2_x_tensor_2_takes_the_steps_of_one_plain_process(
        runs, plain, before, after, devices_after, tensor_parallel_after) -> None:  # type: ignore[no-untyped-def]
    plain_steps, plain_weights = plain["rows"]
    steps = steps_of(runs, before, 4, tensor_parallel=2) if before else {}
    assert not before or sorted(steps) == [1, 2, 3]
    steps.update(steps_of(runs, after, devices_after, tensor_parallel=tensor_parallel_after))
    assert [steps[step] for step in sorted(steps)] == plain_steps
    assert_weights_equal(runs, after, plain_weights)


@pytest.mark.parametrize(("before", "devices_before", "after", "devices_after"), [
    (None, 0, "rr2", 2),
    ("rr2i", 2, "rr2to3", 3),
])
def test_per_rank_batches_of_a_stream_see_each_sample_once_per_epoch(
        runs, before, devices_before, after, devices_after) -> None:  # type: ignore[no-untyped-def]
    steps = steps_of(runs, before, devices_before) if before else {}
    steps.update(steps_of(runs, after, devices_after))
    for epoch in range(job.EPOCHS):
        seen = [i for step, samples in steps.items() if (step - 1) // STEPS_PER_EPOCH == epoch for i in samples]
        assert sorted(seen) == list(range(job.SAMPLES)), f"epoch {epoch}"


@pytest.mark.parametrize("tag", ["e2", "e3"])
def test_an_evaluation_pass_over_a_stream_gathers_each_sample_once(runs, tag) -> None:  # type: ignore[no-untyped-def]
    assert sorted(json.loads((runs / f"{tag}-gathered.json").read_text())) == list(range(9))
