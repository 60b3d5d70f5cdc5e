"""The chaos job (tests/_chaos.py): two `ddp_ft` replica groups of a user's loop that streams a
Hugging Face dataset from an S3 bucket (moto's server on 127.0.0.1) through a shuffle buffer, saves
to that bucket after every step, some in the background, logs to trackio, an MLflow server (on
127.0.0.1) and a W&B offline run, and keeps its own ledger of the samples it trained, run under a
seeded schedule of faults: SIGKILL of a group or of the whole job, SIGTERM to the job, the store
down, the MLflow server down, a slow group.
Each seed's schedule is printed; `LITE_CHAOS_SEED=S` runs seed S alone (replay a failure), and
`benchmarks/chaos_soak.py --faults N --seed S` runs longer schedules.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from conftest import free_port, script_env  # the repository's conftest.py


def _harness():
    spec = importlib.util.spec_from_file_location("_chaos", Path(__file__).parent / "_chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["_chaos"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


_chaos = _harness()

@pytest.fixture
def quick_lighthouse() -> Iterator[str]:
    """A lighthouse that forms a quorum of whichever groups asked within 1 s (the `lighthouse`
    fixture waits 10 s for a heartbeating group that has not asked): the chaos job's restarts
    need not meet in one quorum, since a group that comes late heals, and waiting costs CI time."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    yield f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_chaos.MLflowServer]:
    """One MLflow tracking server for the module (each run logs to its own experiment)."""
    server = _chaos.MLflowServer(tmp_path_factory.mktemp("mlflow"), free_port())
    server.start()
    yield server
    server.stop()


#: Three schedules of two faults that together hold every kind (4: kill-group, kill-job; 7:
#: store-down, slow-group; 9: preempt-job, tracker-down), bounded for CI; the soak runs longer ones.
SEEDS = [int(os.environ["LITE_CHAOS_SEED"])] if os.environ.get("LITE_CHAOS_SEED") else [4, 7, 9]
FAULTS = 2


@pytest.mark.timeout(900)  # a hang guard (a seed takes about 270 s): each wait inside is bounded too (_chaos.PATIENCE)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_job_under_random_faults_loses_no_sample_and_ends_where_one_plain_process_ends(
        quick_lighthouse: str, tmp_path: Path, s3_server, s3_bucket: str, mlflow_server: _chaos.MLflowServer,
        seed: int) -> None:
    schedule = _chaos.draw(seed, FAULTS)
    print(f"LITE_CHAOS_SEED={seed} replays this run", flush=True)
    report = _chaos.run(tmp_path, quick_lighthouse, f"{s3_bucket}/chaos", s3_server, script_env, free_port, schedule,
                        mlflow_server)
    assert report.samples_repeated == 0
