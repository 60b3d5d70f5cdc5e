"""Collectives, ranks, return values and repeated `run()` calls with 2 real processes over gloo.

`tests/scripts/collectives.py` runs once per strategy (module-scoped cache); each test checks one
behaviour in what the ranks recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

STRATEGIES = ["ddp", "ddp_spawn", "ddp_fork"]


class Job:
    """What one run of collectives.py left behind."""

    def __init__(self, out_dir: Path, proc: Any) -> None:
        self.proc = proc
        self.ranks = {}
        for path in out_dir.glob("rank*_*.json"):
            record = json.loads(path.read_text())
            self.ranks[(record["global_rank"], record["call"])] = record
        self.callers = [json.loads(p.read_text()) for p in sorted(out_dir.glob("caller_*.json"))]

    def rank(self, rank: int, call: int) -> dict[str, Any]:
        return self.ranks[(rank, call)]

    def original_process(self) -> dict[str, Any]:
        """The caller record of the process the test started (its parent is this pytest process)."""
        mine = [c for c in self.callers if c["ppid"] == os.getpid()]
        assert len(mine) == 1, self.callers
        return mine[0]


@pytest.fixture(scope="module")
def collectives_job(run_script, output_of, tmp_path_factory):
    jobs: dict[str, Job] = {}

    def get(strategy: str) -> Job:
        if strategy not in jobs:
            out_dir = tmp_path_factory.mktemp(f"collectives-{strategy}")
            proc = run_script("collectives.py", strategy, out_dir)
            assert proc.returncode == 0, output_of(proc)
            jobs[strategy] = Job(out_dir, proc)
            assert set(jobs[strategy].ranks) == {(0, 1), (1, 1), (0, 2), (1, 2)}, output_of(proc)
        return jobs[strategy]

    return get


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_and_world_size(strategy, collectives_job):
    job = collectives_job(strategy)
    for call in (1, 2):
        zero, one = job.rank(0, call), job.rank(1, call)
        assert zero["strategy_name"] == one["strategy_name"] == strategy
        assert (zero["global_rank"], one["global_rank"]) == (0, 1)
        assert (zero["local_rank"], one["local_rank"]) == (0, 1)
        assert zero["node_rank"] == one["node_rank"] == 0
        assert zero["world_size"] == one["world_size"] == 2
        assert zero["is_global_zero"] is True and one["is_global_zero"] is False
        assert zero["pid"] != one["pid"], "both ranks ran in the same process"
        assert zero["dist_initialized"] and one["dist_initialized"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_barrier_waits_for_every_rank(strategy, collectives_job):
    job = collectives_job(strategy)
    for call in (1, 2):
        zero, one = job.rank(0, call), job.rank(1, call)
        # Rank 1 sleeps 1 s before the barrier; rank 0 may only leave once rank 1 arrived.
        assert zero["after_barrier"] >= one["before_barrier"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_broadcast_of_python_object(strategy, collectives_job):
    job = collectives_job(strategy)
    for call in (1, 2):
        expected = {"text": "from rank 0", "items": [1, 2, 3], "call": call}
        for rank in (0, 1):
            record = job.rank(rank, call)
            assert record["broadcast"] == expected  # rank 1 passed None
            assert record["broadcast_src1"] == "rank 1 says hi"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_gather_stacks_every_rank(strategy, collectives_job):
    job = collectives_job(strategy)
    for call in (1, 2):
        for rank in (0, 1):
            record = job.rank(rank, call)
            assert record["all_gather_shape"] == [2, 2]
            assert record["all_gather"] == [[1.0, 10.0], [2.0, 20.0]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_reduce_sum_mean_max(strategy, collectives_job):
    job = collectives_job(strategy)
    for call in (1, 2):
        for rank in (0, 1):
            record = job.rank(rank, call)
            # rank 0 contributes [1, 0], rank 1 contributes [2, -3]
            assert record["all_reduce_sum"] == [3.0, -3.0]
            assert record["all_reduce_mean"] == [1.5, -1.5]
            assert record["all_reduce_max"] == [2.0, 0.0]
            assert record["input_after_reduce"] == [rank + 1.0, -3.0 * rank], "the input was modified"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_of_python_numbers_containers_and_mismatched_shapes(strategy, collectives_job,
                                                                        check_user_collectives):
    job = collectives_job(strategy)
    check_user_collectives({rank: job.rank(rank, 1)["user_collectives"] for rank in (0, 1)})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_run_returns_rank_zero_value_to_caller(strategy, collectives_job):
    job = collectives_job(strategy)
    caller = job.original_process()
    zero, one = job.rank(0, 1), job.rank(1, 1)
    assert caller["first"] == {"rank": 0, "pid": zero["pid"], "call": 1, "answer": 40}
    if strategy == "ddp":
        # The script launcher makes the original process rank 0 and re-runs the script for rank 1.
        assert caller["pid"] == zero["pid"]
        assert one["ppid"] == caller["pid"]
        assert len(job.callers) == 2
        rank_one_caller = next(c for c in job.callers if c["pid"] == one["pid"])
        assert rank_one_caller["first"]["rank"] == 1  # run() on rank 1 returns rank 1's own value
    else:
        # spawn/fork: the original process only launches; both ranks are its children.
        assert len(job.callers) == 1
        assert caller["pid"] not in (zero["pid"], one["pid"])
        assert zero["ppid"] == one["ppid"] == caller["pid"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_run_called_twice(strategy, collectives_job):
    job = collectives_job(strategy)
    caller = job.original_process()
    second_zero = job.rank(0, 2)
    assert caller["second"] == {"rank": 0, "pid": second_zero["pid"], "call": 2, "answer": 40}
    for rank in (0, 1):
        first, second = job.rank(rank, 1), job.rank(rank, 2)
        assert second["environment_ready"] and second["dist_initialized"]
        assert second["init_calls_at_end"] == 1, "the process group was initialised twice in one process"
        if strategy == "ddp":
            # Same processes, same strategy object: the process group from call 1 is reused.
            assert second["pid"] == first["pid"]
            assert second["strategy_id"] == first["strategy_id"]
            assert second["init_calls_at_start"] == 1
        else:
            # Each launch starts fresh workers, each of which initialises its own group once.
            assert second["pid"] != first["pid"]
    if strategy == "ddp":
        assert caller["between"] == {"environment_ready": True, "dist_initialized": True}
        assert caller["init_calls"] == 1
    else:
        # The launching process itself never joins the process group.
        assert caller["between"] == {"environment_ready": False, "dist_initialized": False}
        assert caller["init_calls"] == 0
