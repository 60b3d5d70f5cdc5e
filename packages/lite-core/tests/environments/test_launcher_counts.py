"""`LightningLite(devices=..., num_nodes=...)` left at their defaults take the counts of the launcher
or scheduler that started the processes; counts the code names that disagree are still refused."""

from __future__ import annotations

import sys
import warnings
import types

import pytest

from lite_core import LightningLite
from lite_core.errors import ConfigurationError

pytestmark = pytest.mark.usefixtures("clean_env")

#: What each launcher exports to one of its processes: 2 per node on 3 nodes (6 in total).
LAUNCHERS = {
    "torchrun": dict(TORCHELASTIC_RUN_ID="job", RANK=3, LOCAL_RANK=1, WORLD_SIZE=6, LOCAL_WORLD_SIZE=2,
                     GROUP_RANK=1, MASTER_ADDR="10.0.0.1", MASTER_PORT=29400),
    "slurm": dict(SLURM_NTASKS=6, SLURM_JOB_NAME="train.sh", SLURM_PROCID=3, SLURM_LOCALID=1, SLURM_NODEID=1,
                  SLURM_NODELIST="node[01-03]", SLURM_JOB_ID=7, SLURM_NTASKS_PER_NODE=2, SLURM_NNODES=3),
    "mpi": dict(OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_LOCAL_RANK=1, OMPI_COMM_WORLD_SIZE=6,
                OMPI_COMM_WORLD_LOCAL_SIZE=2, MASTER_ADDR="head"),
    # Ray Train (and any launcher that exports torch's variables without torchrun's run id).
    "ray-style": dict(RANK=3, LOCAL_RANK=1, WORLD_SIZE=6, LOCAL_WORLD_SIZE=2, NODE_RANK=1,
                      MASTER_ADDR="10.0.0.1", MASTER_PORT=29400),
}  # fmt: skip


def launched_by(monkeypatch: pytest.MonkeyPatch, launcher: str, **overrides: object) -> None:
    for name, value in {**LAUNCHERS[launcher], **overrides}.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_counts_left_out_are_the_launchers(monkeypatch, launcher):
    launched_by(monkeypatch, launcher)
    lite = LightningLite(accelerator="cpu", strategy="ddp")
    assert (lite.strategy.num_nodes, len(lite.strategy.device_indexes)) == (3, 2)
    lite.strategy.sync_ranks()  # what setting up the processes does first (a no-op where the launcher says)
    assert (lite.world_size, lite.global_rank, lite.local_rank, lite.node_rank) == (6, 3, 1, 1)


def test_kubeflow_runs_one_process_per_pod(monkeypatch):
    for name, value in dict(KUBERNETES_PORT="tcp://10.96.0.1:443", MASTER_ADDR="job-master-0", MASTER_PORT=23456,
                            WORLD_SIZE=3, RANK=2).items():
        monkeypatch.setenv(name, str(value))
    lite = LightningLite(accelerator="cpu", strategy="ddp")
    assert (lite.strategy.num_nodes, len(lite.strategy.device_indexes), lite.world_size) == (3, 1, 3)


def test_a_count_the_code_names_is_kept_and_the_other_taken_from_the_launcher(monkeypatch):
    launched_by(monkeypatch, "torchrun")
    lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2)
    assert lite.strategy.num_nodes == 3


def test_without_a_launcher_the_signature_defaults_hold():
    lite = LightningLite(accelerator="cpu")
    assert (lite.strategy.num_nodes, lite.world_size) == (1, 1)


def test_a_num_nodes_the_launcher_does_not_run_is_refused_in_one_sentence(monkeypatch):
    launched_by(monkeypatch, "torchrun", WORLD_SIZE=2, RANK=1, GROUP_RANK=0)  # one node of 2 processes
    with pytest.raises(ConfigurationError) as error:
        LightningLite(accelerator="cpu", strategy="ddp", num_nodes=2)
    message = str(error.value)
    assert message.startswith("torchrun started 2 processes in total but LightningLite(devices=2, num_nodes=2)")
    assert "leave devices and num_nodes out of LightningLite(...)" in message
    assert "\n" not in message and message.endswith("counts.")


def test_devices_that_disagree_with_the_launcher_are_refused(monkeypatch):
    launched_by(monkeypatch, "slurm")
    with pytest.raises(ConfigurationError, match=r"SLURM runs 2 tasks per node but LightningLite\(devices=4\)"):
        LightningLite(accelerator="cpu", strategy="ddp", devices=4)


def test_a_ray_train_worker_is_recognised_even_inside_a_slurm_allocation(monkeypatch):
    launched_by(monkeypatch, "slurm", SLURM_NTASKS=1, SLURM_NTASKS_PER_NODE=1, SLURM_NNODES=1)  # Ray's own job
    launched_by(monkeypatch, "ray-style")
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))  # a Ray worker has Ray imported
    lite = LightningLite(accelerator="cpu", strategy="ddp")
    assert lite.strategy.environment.name == "ray"
    assert (lite.strategy.num_nodes, lite.world_size, lite.global_rank, lite.node_rank) == (3, 6, 3, 1)
    with pytest.raises(ConfigurationError, match=r"^Ray Train started 2 worker\(s\) on this node and 6 in total"):
        LightningLite(accelerator="cpu", strategy="ddp", devices=1)


def test_lite_runs_count_that_disagrees_with_the_code_is_refused_in_lite_runs_words(monkeypatch):
    """`lite run --devices 1 train.py` with `devices=2` in the code: the processes are started, so
    the code cannot win; no "ignored" warning, one sentence that names `lite run`'s flag."""
    launched_by(monkeypatch, "torchrun", LOCAL_WORLD_SIZE=1, WORLD_SIZE=3, LITE_DEVICES=1, LITE_LAUNCHER_PID=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the count is not "ignored": it is the processes'
        with pytest.raises(ConfigurationError, match=r"^lite run started 1 processes per node but"
                           r" LightningLite\(devices=2\) asks for 2: .* or lite run --devices=2\.$"):
            LightningLite(accelerator="cpu", strategy="ddp", devices=2)
    monkeypatch.setenv("LITE_NUM_NODES", "3")
    with pytest.raises(ConfigurationError, match=r"^lite run started 3 processes in total but .*"
                       r"lite run --num-nodes=2, or leave devices and num_nodes out"):
        LightningLite(accelerator="cpu", strategy="ddp", devices=1, num_nodes=2)
