"""The same loop under `fsdp` and `ddp` (optimizer with two param groups and an LR scheduler built
before `setup(model, optimizer)`), and checkpoints that move between strategies: save under `fsdp`
on 2 processes (sharded and full), resume under `fsdp`, `ddp` and `single_device`, each continuing
the uninterrupted loss curve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lite_core.checkpoint import consolidate, is_sharded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

RESUME_AT = 3


@pytest.fixture(scope="module")
def saved(run_script, output_of, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp-save")
    proc = run_script("sharded_resume.py", "save", "fsdp", out_dir)
    assert proc.returncode == 0, output_of(proc)
    losses = json.loads((out_dir / "uninterrupted.json").read_text())
    assert len(losses) == 6
    return out_dir, losses


def test_a_save_that_fails_on_rank_0_raises_on_every_rank_under_fsdp(saved):
    out_dir, _ = saved
    errors = [json.loads((out_dir / f"failed_saves_rank{r}.json").read_text()) for r in (0, 1)]
    for rank, by_kind in enumerate(errors):
        assert set(by_kind) == {"sharded", "full"}, by_kind
        for error in by_kind.values():
            assert error["type"] == "CheckpointError" and "failed on rank 0 with" in error["message"], error
            assert error["cause"] == (None if rank else error["cause"])
    assert all(error["cause"] for error in errors[0].values())  # rank 0 chains its own error


def test_the_same_loop_under_fsdp_and_ddp_has_the_same_loss_curve(saved, run_script, output_of, tmp_path):
    _, fsdp_losses = saved
    proc = run_script("sharded_resume.py", "save", "ddp", tmp_path)
    assert proc.returncode == 0, output_of(proc)
    ddp_losses = json.loads((tmp_path / "uninterrupted.json").read_text())
    torch.testing.assert_close(torch.tensor(fsdp_losses), torch.tensor(ddp_losses), atol=1e-6, rtol=0)


def resumed_losses(run_script, output_of, strategy: str, devices: int, checkpoint, out_json,
                   at: int = RESUME_AT) -> list[float]:
    proc = run_script("sharded_resume.py", "resume", strategy, devices, checkpoint, out_json, at)
    assert proc.returncode == 0, output_of(proc)
    return json.loads(out_json.read_text())


@pytest.mark.parametrize(("strategy", "devices", "kind"), [
    ("fsdp", 2, "sharded"),
    ("ddp", 2, "sharded"),
    ("single_device", 1, "sharded"),
    ("fsdp", 1, "sharded"),
    ("fsdp", 2, "full.pt"),
    ("single_device", 1, "full.pt"),
])
def test_resume_continues_the_uninterrupted_loss_curve(saved, run_script, output_of, tmp_path, strategy, devices, kind):
    out_dir, uninterrupted = saved
    losses = resumed_losses(run_script, output_of, strategy, devices, out_dir / kind, tmp_path / "losses.json")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted[RESUME_AT:]), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("strategy", "devices", "kind"), [
    ("fsdp", 2, "step0_sharded"),
    ("fsdp", 2, "step0_full.pt"),
    ("single_device", 1, "step0_full.pt"),
])
def test_a_checkpoint_saved_before_the_first_step_resumes_the_whole_curve(saved, run_script, output_of, tmp_path,
                                                                          strategy, devices, kind):
    # torch fills a never-stepped optimizer's state with a step of zero gradients when it is
    # saved; the saving run (compared with ddp above) and a resumed one must not count that step.
    out_dir, uninterrupted = saved
    losses = resumed_losses(run_script, output_of, strategy, devices, out_dir / kind, tmp_path / "losses.json", at=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted), atol=1e-6, rtol=0)


def test_sharded_checkpoint_is_a_directory_of_shards_and_full_is_one_file(saved):
    out_dir, _ = saved
    sharded = out_dir / "sharded"
    assert is_sharded(sharded)
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # Saving again to the same path replaced the older checkpoint and left no staging directory.
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "failed_saves_rank0.json", "failed_saves_rank1.json", "full.pt", "sharded", "step0_full.pt", "step0_sharded",
        "uninterrupted.json"]
    assert torch.load(out_dir / "step0_full.pt", weights_only=True)["optimizer"]["state"] == {}  # as before a step
    assert torch.load(sharded / "lite_extra.pt", weights_only=True)["step"] == RESUME_AT
    full = torch.load(out_dir / "full.pt", weights_only=True)
    assert full["step"] == RESUME_AT
    assert full["model"]["0.weight"].shape == (16, 4)  # gathered, not a shard
    assert set(full["optimizer"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert [group["lr"] for group in full["optimizer"]["param_groups"]] == [0.025, 0.005]  # halved at step 2
    assert full["scheduler"]["last_epoch"] == RESUME_AT  # the scheduler's state, loadable with weights_only


def test_consolidate_writes_one_torch_loadable_file_that_resumes(saved, run_script, output_of, tmp_path):
    out_dir, uninterrupted = saved
    target = tmp_path / "consolidated.pt"
    consolidate(out_dir / "sharded", target)
    content = torch.load(target, weights_only=True)
    full = torch.load(out_dir / "full.pt", weights_only=True)
    assert content["step"] == RESUME_AT
    for name, tensor in full["model"].items():
        assert torch.equal(content["model"][name], tensor), name
    losses = resumed_losses(run_script, output_of, "single_device", 1, target, tmp_path / "losses.json")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted[RESUME_AT:]), atol=1e-6, rtol=0)


def test_lite_consolidate_command_writes_the_same_file(saved, tmp_path):
    out_dir, _ = saved
    target = tmp_path / "by_cli.pt"
    launcher = Path(sys.executable).with_name("lite")  # the installed console script
    proc = subprocess.run([str(launcher), "consolidate", str(out_dir / "sharded"), str(target)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    full = torch.load(out_dir / "full.pt", weights_only=True)
    content = torch.load(target, weights_only=True)
    for name, tensor in full["model"].items():
        assert torch.equal(content["model"][name], tensor), name
    broken = subprocess.run([str(launcher), "consolidate", str(tmp_path), str(tmp_path / "x.pt")],
                            capture_output=True, text=True, timeout=120)
    assert broken.returncode == 2
    assert broken.stderr.startswith("lite consolidate: error:") and broken.stderr.count("\n") == 1
