"""`benchmarks/gpu_check.sh`, the prepared GPU check, run on the CPU (`GPU_CHECK_DEVICE=cpu`): the
script itself must work when a GPU is lent, since a lent machine gives one short try."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(os.environ.get("LITE_GPU_CHECK_INSIDE") == "1",
                    reason="this is the check's own run of lite-cuda's tests: it must not start itself again")
@pytest.mark.timeout(900)  # hang guard: about 70 s on an idle machine
def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="test-cuda installs torchao: the check's FP8 part needs it")
    pytest.importorskip("torchft", reason="test-cuda installs torchft: the check's ddp_ft cell needs it")
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "PYTHON": sys.executable, "LITE_GPU_CHECK_INSIDE": "1"}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == [
        "tests", "benchmark", "deepspeed tests", "deepspeed parity and step time", "model parallel", "fp8",
        "context parallel", "gpu paths", "expert parallel", "fp8 experts"]
    assert all(": exit 0" in line for line in summary), summary
    assert "passed" in summary[0] and "failed" not in summary[0]
    assert "model parallel dp1 x tp2 (two nodes sharing device 0)" in summary[-6]  # over gloo
    assert summary[-6].endswith(": ok)"), summary[-6]
    assert "context parallel: skipped, the ring needs a GPU" in summary[-4]  # the script ran, saw no GPU
    assert summary[-3].endswith("(4 ok, 0 skipped)"), summary[-3]  # on the CPU ddp_ft and the pipeline run over gloo
    # Lite's expert-parallel step against the job by hand (bf16, grouped_mm, over gloo): the same losses.
    assert "expert parallel (cpu, smoke): Lite / by hand" in summary[-2] and summary[-2].endswith("losses equal: ok)")
    # The experts' grouped products: bf16 against the loop here; the FP8 arms say why they did not run.
    assert summary[-1].startswith("fp8 experts: exit 0 (fp8 experts (cpu, smoke): grouped / loop ")
    assert summary[-1].endswith("fp8: skipped, FP8 grouped products need a GPU of compute capability 9.0)")
    assert json.loads((tmp_path / "gpu_bench.json").read_text())
    fp8 = json.loads((tmp_path / "gpu_fp8.json").read_text())
    # Uncompiled on the CPU, Lite's FP8 arm computes exactly what torchao by hand does.
    assert fp8["losses"]["fp8"] == fp8["losses"]["fp8_by_hand"] != fp8["losses"]["bf16"]
