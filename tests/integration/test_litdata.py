"""litdata's `StreamingDataset`, unchanged in a user's loop (`tests/scripts/litdata_job.py`): it
shards itself over the data-parallel ranks, and Lite does not cut its shard again, so each sample
goes to one data-parallel rank per epoch, under `ddp` on 2 and under `model_parallel` (data 2 x
tensor 2: both ranks of a tensor-parallel group read the same samples); litdata's own
`StreamingDataLoader`, saved mid-epoch on 2, resumes on 2 and on 3, and saved on 4 resumes on 2,
with each sample once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

litdata = pytest.importorskip("litdata", reason="needs litdata (installed in the test environment)")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]  # a hang guard: a launch takes seconds

SAMPLES = 96
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "litdata_job.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`OUT/data`: litdata's chunks of the items `{"id": i}`, written by `litdata.optimize` in a
    process of its own (its worker processes and shared memory stay out of the test's)."""
    out = tmp_path_factory.mktemp("litdata")
    subprocess.run([sys.executable, str(SCRIPT), "optimize", str(SAMPLES), str(out)], check=True, timeout=120,
                   capture_output=True)
    return out


@pytest.mark.parametrize(("strategy", "devices", "tensor_parallel"), [("ddp", 2, 1), ("model_parallel", 4, 2)])
def test_each_sample_goes_to_one_data_parallel_rank(run_script, output_of, data, strategy, devices,
                                                     tensor_parallel) -> None:  # type: ignore[no-untyped-def]
    proc = run_script("litdata_job.py", strategy, devices, data, "read", timeout=240)
    assert proc.returncode == 0, output_of(proc)
    ranks = [json.loads((data / f"read-rank{rank}.json").read_text()) for rank in range(devices)]
    for rank in range(devices):  # the ranks of one tensor-parallel group read the same samples
        assert ranks[rank] == ranks[rank - rank % tensor_parallel], f"rank {rank} left its group's samples"
    read = [i for ids in ranks[::tensor_parallel] for i in ids]
    assert sorted(read) == list(range(SAMPLES)), read  # each sample once: none cut away, none twice


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, (2, 3)), (4, (2,))])
def test_its_own_loader_resumes_mid_epoch_on_as_many_processes_on_more_and_on_fewer(
        run_script, output_of, data, saved_on, resumed_on) -> None:  # type: ignore[no-untyped-def]
    """litdata's `StreamingDataLoader`, set up by Lite and saved after 3 batches on `saved_on`
    processes, resumes from its own state (Lite loads rank 0's) on each of `resumed_on`: every
    sample once over the epoch. (On 1 litdata refuses its own state: its loader drops the last
    batch only above one process, and it checks that `drop_last` matches.)"""
    first = run_script("litdata_job.py", "ddp", saved_on, data, "first", f"on{saved_on}", timeout=240)
    assert first.returncode == 0, output_of(first)
    before = [i for rank in range(saved_on) for i in json.loads((data / f"on{saved_on}-rank{rank}.json").read_text())]
    assert len(before) == saved_on * 3 * 4
    for devices in resumed_on:
        tag = f"from{saved_on}on{devices}"
        resumed = run_script("litdata_job.py", "ddp", devices, data, "resume", tag, f"on{saved_on}", timeout=240)
        assert resumed.returncode == 0, output_of(resumed)
        after = [i for rank in range(devices) for i in json.loads((data / f"{tag}-rank{rank}.json").read_text())]
        assert sorted(before + after) == list(range(SAMPLES)), (devices, sorted(before), sorted(after))
