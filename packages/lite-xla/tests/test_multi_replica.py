"""Several XLA replicas, for real on XLA's CPU device, each job in its own process.

torch-xla runs the replicas of a CPU host as threads of one process; the CPU-only workarounds
they need live in `scripts/_cpu_harness.py` (never in lite-xla), enabled here with
`LITE_XLA_CPU_HARNESS=1`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent / "scripts"
MAX_NORM = 0.05  # scripts/parity.py clips every step to it

_XLA_ENV = {"PJRT_DEVICE": "CPU", "LITE_XLA_CPU_HARNESS": "1"}
_TIMEOUT = 150


def _result(run_script: Callable[..., Any], output_of: Callable[..., str], script: str, mode: str,
            out: Path, env: dict[str, str], *extra: Any) -> dict[str, Any]:
    proc = run_script(SCRIPTS / script, mode, out, *extra, env=env, timeout=_TIMEOUT)
    assert proc.returncode == 0, output_of(proc)
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * _TIMEOUT + 30)
def test_a_ddp_script_moves_to_xla_by_changing_the_constructor_only(
        run_script: Callable[..., Any], output_of: Callable[..., str], tmp_path: Path) -> None:
    # The same run() body: accelerator="cpu", strategy="ddp", devices=2 vs accelerator="tpu", devices=2.
    ddp = _result(run_script, output_of, "collectives.py", "cpu_ddp", tmp_path / "ddp.json", {})
    xla = _result(run_script, output_of, "collectives.py", "xla", tmp_path / "xla.json", _XLA_ENV)
    assert ddp.pop("strategy") == "ddp" and xla.pop("strategy") == "xla"
    assert xla == ddp
    assert xla == {
        "world_size": 2, "sum": 4.5, "mean": [2.25, 1.0], "max": 1.0, "gathered": [[0, 0], [1, 10]],
        "message": {"from": 0, "text": "hello"}, "seen": [[0, 2, 4, 6], [1, 3, 5, 7]],
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(_TIMEOUT + 30)
def test_using_the_device_before_launch_is_reported_in_one_sentence(
        run_script: Callable[..., Any], output_of: Callable[..., str]) -> None:
    proc = run_script(SCRIPTS / "touch_device_first.py", env={"PJRT_DEVICE": "CPU"}, timeout=_TIMEOUT)
    assert proc.returncode == 0, output_of(proc)
    assert ("MisuseError: The XLA device was used in this process before Lite started the replicas"
            in proc.stdout), output_of(proc)
    assert "move that code into run()" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(3 * _TIMEOUT + 30)
def test_two_replicas_train_like_one_full_batch_process_and_like_ddp_with_clipping_groups_and_a_scheduler(
        run_script: Callable[..., Any], output_of: Callable[..., str], tmp_path: Path) -> None:
    full = _result(run_script, output_of, "parity.py", "full_batch", tmp_path / "full.json", {})
    ddp = _result(run_script, output_of, "parity.py", "cpu_ddp", tmp_path / "ddp.json", {})
    xla = _result(run_script, output_of, "parity.py", "xla", tmp_path / "xla.json", _XLA_ENV)
    assert (xla["strategy"], xla["world_size"], xla["ranks"], xla["samples_per_step"]) == ("xla", 2, [0, 1], 8)
    assert full["samples_per_step"] == 16 and len(xla["losses"]) == len(full["losses"]) == 4
    assert min(full["norms"]) > 10 * MAX_NORM  # every step is clipped, hard
    for other in (full, ddp):
        assert xla["losses"] == pytest.approx(other["losses"], abs=1e-5)
        assert xla["norms"] == pytest.approx(other["norms"], abs=1e-5)  # of the averaged gradients
        assert xla["lrs"] == other["lrs"]
        for got, want in zip(xla["weights"], other["weights"]):
            assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * _TIMEOUT + 30)
def test_two_fsdp_replicas_clip_by_the_global_norm_keep_groups_and_scheduler_and_save_shards(
        run_script: Callable[..., Any], output_of: Callable[..., str], tmp_path: Path) -> None:
    full = _result(run_script, output_of, "parity.py", "full_batch", tmp_path / "full.json", {})
    sharded = tmp_path / "sharded"
    fsdp = _result(run_script, output_of, "parity.py", "xla_fsdp", tmp_path / "fsdp.json", _XLA_ENV, sharded)
    assert (fsdp["strategy"], fsdp["world_size"], fsdp["ranks"], fsdp["samples_per_step"]) == ("xla_fsdp", 2, [0, 1], 8)
    assert min(full["norms"]) > 10 * MAX_NORM  # every step is clipped, hard
    # Clipped by the norm over every shard; two groups with their own lr, a StepLR made before setup.
    assert fsdp["norms"] == pytest.approx(full["norms"], abs=1e-5)
    assert fsdp["lrs"] == full["lrs"] == [[1.0, 0.5], [1.0, 0.5], [0.1, 0.05], [0.1, 0.05]]
    assert fsdp["losses"] == pytest.approx(full["losses"], abs=1e-5)
    assert sorted(f.name for f in sharded.iterdir()) == ["shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]

    import torch

    from lite_xla import consolidate_checkpoint

    # Each replica holds a padded flat shard of every parameter; the consolidated checkpoint is
    # the user's module, trained: compare it with the full-batch process's weights.
    model = consolidate_checkpoint(sharded)["model"]
    assert list(model) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for got, want in zip(model.values(), full["weights"]):
        assert got.flatten().tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(_TIMEOUT + 30)
def test_an_fsdp_checkpoint_loaded_into_weights_of_other_shapes_is_refused_as_a_mismatch(
        run_script: Callable[..., Any], output_of: Callable[..., str], tmp_path: Path) -> None:
    # [32, 8] saved, [8, 32] loading: the same number of elements, so every replica's flat padded
    # shard has the same shape, and torch-xla's load_state_dict copied it without a word.
    result = _result(run_script, output_of, "mismatch.py", "xla_fsdp", tmp_path / "mismatch.json", _XLA_ENV,
                     tmp_path / "checkpoint")
    assert result["error"] == (
        "CheckpointError: The checkpoint's weights do not fit this Sequential: 1 weight has another shape in the"
        " checkpoint ('0.weight': (32, 8) saved, (8, 32) here): load it into a model built like the one it was"
        " saved from (strict=False passes over missing and unexpected keys, not weights of another shape).")
    assert result["loaded_same"]


@pytest.mark.multiprocess
@pytest.mark.timeout(_TIMEOUT + 30)
@pytest.mark.parametrize("mode", ["xla", "xla_fsdp"])
def test_an_adapters_only_checkpoint_holds_the_trained_weights_whole_and_resumes_exactly(
        mode: str, run_script: Callable[..., Any], output_of: Callable[..., str], tmp_path: Path) -> None:
    # Under xla_fsdp, torch-xla's FSDP takes the parameters out of the module: the set-up model's
    # state dict was empty, so the adapters-only checkpoint held nothing and loaded nothing, silently.
    result = _result(run_script, output_of, "adapters.py", mode, tmp_path / "adapters.json", _XLA_ENV,
                     tmp_path / "checkpoint")
    assert result["keys"] == ["2.bias", "2.weight"]  # the trained layer alone, whole, under its own names
    assert result["resumed_equal"] and result["base_untouched"] and result["moved"] > 1e-2
    plain = _plain_adapters()
    for name, values in result["trained"].items():
        torch.testing.assert_close(torch.tensor(values), plain[name], rtol=0, atol=1e-6)


def _plain_adapters() -> dict[str, torch.Tensor]:
    """scripts/adapters.py's two steps in one plain process (both replicas train on the same batch)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from _adapters_model import build
    finally:
        sys.path.remove(str(SCRIPTS))
    model = build(adapter_seed=2)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in range(2):
        generator = torch.Generator().manual_seed(10 + step)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {"2.weight": model[2].weight.detach(), "2.bias": model[2].bias.detach()}


@pytest.mark.multiprocess
@pytest.mark.timeout(_TIMEOUT + 30)
@pytest.mark.parametrize("how", ["raise", "exit", "kill"])
def test_a_failing_replica_ends_the_job_at_once(how: str, start_script: Callable[..., Any],
                                                processes_in_session: Callable[[int], list[int]],
                                                wait_gone: Callable[[list[int], float], list[int]],
                                                tmp_path: Path) -> None:
    stamp = tmp_path / "failed_at"
    job = start_script(SCRIPTS / "failing_replica.py", stamp, how, env=_XLA_ENV)  # its own session
    stdout, stderr = job.communicate(timeout=_TIMEOUT)
    ended = time.time()
    output = stdout + stderr
    assert job.returncode != 0, output
    assert ended - float(stamp.read_text()) < 10, output  # replica 0 did not wait for a timeout
    assert "ReplicaFailedError: An XLA replica process ended before finishing" in output
    if how == "raise":
        assert "ValueError: replica one broke" in output
        assert "lite: XLA replica 1 failed with the error above; stopping every replica." in output
    # The replica processes die with the launching process (parent-death SIGKILL): the kernel may
    # still be taking one down at the instant the launcher's exit is seen.
    assert wait_gone(processes_in_session(job.pid), 3.0) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(_TIMEOUT + 30)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launching_process_ends_every_replica(sig: signal.Signals, start_script: Callable[..., Any],
                                                              processes_in_session: Callable[[int], list[int]],
                                                              tmp_path: Path) -> None:
    job = start_script(SCRIPTS / "waiting_replicas.py", tmp_path, env=_XLA_ENV)  # its own session
    deadline = time.monotonic() + _TIMEOUT
    while len(list(tmp_path.glob("ready_rank*"))) < 2:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)
    time.sleep(0.5)  # replica 0 is now in its barrier
    os.kill(job.pid, sig)  # the launching process only, not its group
    sent = time.monotonic()
    job.wait(timeout=30)  # not communicate(): a surviving replica would keep the pipes open
    while processes_in_session(job.pid) and time.monotonic() - sent < 8:
        time.sleep(0.1)
    assert processes_in_session(job.pid) == [], f"replicas outlived {sig.name} by 8 s"
    assert job.returncode == -sig, job.communicate()[1]
