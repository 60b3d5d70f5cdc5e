"""`LightningLite.profile()` in a 2-process job (`tests/scripts/profile_job.py`): one Chrome
trace per profiled rank in the user's folder, holding the scheduled steps (marked through the
monitor's `step()` or the user's), and nothing from ranks that were not chosen; the monitor's
metrics reach the CSV logger."""

from __future__ import annotations

import csv
import json

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _profiled_steps(trace: dict) -> set[str]:
    return {event["name"] for event in trace["traceEvents"] if str(event.get("name", "")).startswith("ProfilerStep#")}


def test_one_chrome_trace_per_rank_with_the_scheduled_steps(run_script, output_of, tmp_path):
    # Fresh interpreters: in one full run on a loaded machine, a rank forked from the test session's
    # fork server (tools/forkserver) aborted with a corrupted heap right after kineto's profiler_stop
    # (not reproduced in 24 runs since, forked); the profiler's state is not worth that doubt.
    proc = run_script("profile_job.py", tmp_path, env={"LITE_TEST_FORKSERVER": "0"})
    assert proc.returncode == 0, output_of(proc)
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["trace-rank0.json", "trace-rank1.json"]
    for rank in (0, 1):
        trace = json.loads((tmp_path / "all" / f"trace-rank{rank}.json").read_text())
        assert _profiled_steps(trace) == {"ProfilerStep#2", "ProfilerStep#3"}, rank  # after wait 1 + warm-up 1
    assert [p.name for p in (tmp_path / "rank1").iterdir()] == ["trace-rank1.json"]

    [metrics_file] = (tmp_path / "logs").rglob("*.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    assert [row["step"] for row in rows] == ["3", "6"]
    assert float(rows[-1]["throughput/samples_per_sec"]) > 0 and float(rows[-1]["throughput/flops_per_sec"]) > 0
    assert "throughput/mfu" not in rows[-1]  # no known peak on the CPU
