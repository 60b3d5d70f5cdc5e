"""A Lite script's `run()` inside a Ray Train `TorchTrainer` on a local Ray cluster of 2 CPUs: Lite
launches nothing, takes Ray's process counts, reuses the process group Ray created, and ends equal
to the one-process run; Ray's own restart (`FailureConfig(max_failures=1)`) resumes from the
user's checkpoint. One cluster serves the module (starting Ray costs seconds).

A `strategy="ddp_ft"` script runs unchanged under Ray's `TorchftConfig` (lite-torchft takes its
replica group from Ray, and the ranks from the process group Ray created for the group), and a
worker that dies is replaced by Ray alone and heals from the survivor."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="needs lite-core[ray]: these tests run in the test-ray environment")
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

# A hang guard, not a speed check: a fit takes about 1 minute alone, 2.5 minutes beside 4 busy
# processes on 2 cores, and CI's machine can be twice as slow as that.
pytestmark = [pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.timeout(480)]

SCRIPTS = Path(__file__).parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import ray_ft_job  # noqa: E402
import ray_job  # noqa: E402
from elastic_job import reference_weights  # noqa: E402

sys.path.remove(str(SCRIPTS))


# torchft reads these over the timeouts `ddp_ft` passes its Manager. The job finds its dead worker
# through the lighthouse's heartbeats, never through a timeout, so these only guard against a hang:
# under `test`'s two busy workers a 60 s quorum call once expired while the replacement was set up.
FT_HANG_GUARDS = {"TORCHFT_TIMEOUT_SEC": "120", "TORCHFT_QUORUM_TIMEOUT_SEC": "300",
                  "TORCHFT_CONNECT_TIMEOUT_SEC": "120"}


@pytest.fixture(scope="module")
def local_cluster():
    env_vars = {"PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
                "LITE_COLLECTIVE_TIMEOUT": "60", "OMP_NUM_THREADS": "1", **FT_HANG_GUARDS}
    # Ray starts its workers at niceness 15: beside the suite's other environments, which run at 0
    # on the same 2 cores, they got almost no CPU and a 1-minute fit ran past its 300 s timeout.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_worker_niceness", "0")  # read by the raylet that ray.init starts
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env_vars})
    yield
    ray.shutdown()


def fit(out_dir: Path, how: str, max_failures: int = 0) -> None:
    trainer = TorchTrainer(ray_job.train, train_loop_config={"out_dir": str(out_dir), "how": how},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=str(out_dir / "ray"), name="lite",
                                                failure_config=FailureConfig(max_failures=max_failures)))
    trainer.fit()


def assert_equal_to_the_one_process_run(out_dir: Path) -> None:
    expected = reference_weights()
    for rank in (0, 1):
        record = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert (record["world"], record["environment"]) == (2, "ray")
        for got, want in zip(record["weight"], expected):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)


def test_two_ray_workers_train_as_one_process_and_rays_restart_resumes_from_the_users_checkpoint(
        local_cluster, tmp_path):
    # One fit covers both (each costs a minute of CPU on 2 cores): the first attempt starts from
    # scratch and trains epoch 0 on both workers, worker 1 dies in epoch 1, and Ray's restart
    # resumes from the checkpoint; the end equals one uninterrupted process only if both did right.
    fit(tmp_path, "die-once", max_failures=1)
    assert (tmp_path / "died").exists()  # worker 1 did die once
    progress = (tmp_path / "progress.txt").read_text().splitlines()
    assert progress == ["epoch 0 world 2", "epoch 1 world 2", "epoch 2 world 2"], progress
    assert_equal_to_the_one_process_run(tmp_path)


def fit_ddp_ft(out_dir: Path, die: bool = False) -> None:
    from ray.train.v2.torch.torchft_config import TorchftConfig

    # A heartbeat 5 s late (not 1 s) drops a group: a starved but live worker stays in the quorum.
    lighthouse = {"min_replicas": 1, "join_timeout_ms": 1000, "heartbeat_timeout_ms": 5000}
    trainer = TorchTrainer(ray_ft_job.train, train_loop_config={"out_dir": str(out_dir), "die": die},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           torch_config=TorchftConfig(lighthouse_kwargs=lighthouse, backend="gloo"),
                           run_config=RunConfig(storage_path=str(out_dir / "ray"), name="lite_ft",
                                                failure_config=FailureConfig(max_failures=int(die))))
    trainer.fit()


def test_a_ddp_ft_script_survives_a_replaced_worker_under_rays_torchft_config(local_cluster, tmp_path):
    """Two workers, each its own replica group of one process (Ray 2.60), with Ray's lighthouse.
    Worker 1 dies after its second step; Ray replaces that group alone; the replacement heals
    from the survivor, which never restarted; with `split_batches=True` both end with the weights
    of one plain PyTorch process."""
    fit_ddp_ft(tmp_path, die=True)
    assert (tmp_path / "died").exists()
    steps: dict[int, list[int]] = {}
    for pid, step in (map(int, line.split()) for line in (tmp_path / "steps").read_text().splitlines()):
        steps.setdefault(pid, []).append(step)
    survivor = [pid for pid, done in steps.items() if done == list(range(1, ray_ft_job.STEPS + 1))]
    assert len(survivor) == 1  # one process took every step, with no restart
    (replacement,) = [int(path.name.split("-")[1]) for path in tmp_path.glob("back-*")]
    assert steps[replacement][0] > 1  # it joined in the middle, healed from the survivor
    written = sorted(tmp_path.glob("weights-*.pt"))
    assert {int(path.stem.split("-")[1]) for path in written} == {survivor[0], replacement}
    expected = ray_ft_job.plain()
    for path in written:
        got = torch.load(path)
        for name, want in expected.items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-5)
