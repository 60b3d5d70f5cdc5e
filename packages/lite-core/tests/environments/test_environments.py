"""Tests of the cluster environments and of `detect_environment`."""

from __future__ import annotations

import os
import socket
import sys
import types
from pathlib import Path
from typing import TypeVar

import pytest

from lite_core.environments import (
    ENVIRONMENTS,
    ClusterEnvironment,
    KubeflowEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    RayTrainEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
)
from lite_core.environments.slurm import parse_slurm_hostlist
from lite_core.errors import ConfigurationError

# Every variable an environment reads is removed first, since the host may have some set
# (the fixture is the repository's conftest.py).
pytestmark = pytest.mark.usefixtures("clean_env")


def set_env(monkeypatch: pytest.MonkeyPatch, **values: object) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


E = TypeVar("E", bound=ClusterEnvironment)


def detected(environment: type[E], ranks: tuple[int, int, int, int]) -> E:
    """`environment` detects itself, starts its processes outside Lite, and has `ranks` (this
    process's global rank, local rank and node rank, and the world size)."""
    assert environment.detect()
    env = environment()
    assert env.creates_processes_externally
    assert (env.global_rank(), env.local_rank(), env.node_rank(), env.world_size()) == ranks
    return env


def assert_validates(env: ClusterEnvironment, accepted: tuple[int, int], refused: dict[tuple[int, int], str]) -> None:
    """`env.validate_settings` accepts the `accepted` (devices, nodes) and refuses each (devices,
    nodes) of `refused` with a `ConfigurationError` matching its pattern."""
    env.validate_settings(num_devices=accepted[0], num_nodes=accepted[1])
    for (devices, nodes), pattern in refused.items():
        with pytest.raises(ConfigurationError, match=pattern):
            env.validate_settings(num_devices=devices, num_nodes=nodes)


# --- torchrun ---------------------------------------------------------------------------------

def set_torchrun(monkeypatch: pytest.MonkeyPatch, **overrides: object) -> None:
    values = dict(
        TORCHELASTIC_RUN_ID="run1", RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4,
        GROUP_RANK=1, MASTER_ADDR="10.0.0.1", MASTER_PORT=29400,
    )  # fmt: skip
    values.update(overrides)
    set_env(monkeypatch, **values)


def test_torchelastic_detect_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not TorchElasticEnvironment.detect()
    set_torchrun(monkeypatch)
    env = detected(TorchElasticEnvironment, (5, 1, 1, 8))
    assert (env.main_address, env.main_port) == ("10.0.0.1", 29400)
    env.set_world_size(3)
    env.set_global_rank(0)
    assert (env.world_size(), env.global_rank()) == (8, 5)


def test_torchelastic_needs_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    set_torchrun(monkeypatch)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not TorchElasticEnvironment.detect()


def test_torchelastic_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    set_torchrun(monkeypatch)
    assert_validates(TorchElasticEnvironment(), accepted=(4, 2), refused={
        (2, 2): r"4 processes per node .*devices=2.*--nproc-per-node=2",
        (4, 3): r"8 processes in total .*expects 12.*--nnodes=3",
    })


def test_torchelastic_validate_without_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    set_torchrun(monkeypatch)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert_validates(TorchElasticEnvironment(), accepted=(2, 4), refused={(2, 2): "8 processes in total"})


def test_bad_integer_is_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    set_torchrun(monkeypatch, RANK="zero")
    with pytest.raises(ConfigurationError, match=r"RANK='zero' is not an integer"):
        TorchElasticEnvironment().global_rank()


# --- Ray Train --------------------------------------------------------------------------------

def test_ray_train_detect_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, NODE_RANK=1, MASTER_ADDR="10.0.0.1",
            MASTER_PORT=29400)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert not RayTrainEnvironment.detect()  # torch's variables alone do not make a Ray worker
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    env = detected(RayTrainEnvironment, (5, 1, 1, 8))
    assert (env.main_address, env.main_port, env.process_counts()) == ("10.0.0.1", 29400, (4, 2))


def test_ray_train_ranks_are_those_of_the_process_group_ray_created(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a Ray backend with replica groups (`TorchftConfig`), `RANK`/`WORLD_SIZE` count the
    whole job while the process group Ray created, which Lite reuses, holds one worker."""
    import torch.distributed as dist

    set_env(monkeypatch, RANK=1, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, NODE_RANK=0, MASTER_PORT=29400)
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = RayTrainEnvironment()
        assert (env.global_rank(), env.world_size(), env.process_counts()) == (0, 1, (1, 1))
        env.validate_settings(num_devices=1, num_nodes=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("environment", "launcher"), [(TorchElasticEnvironment, "torchrun"),
                                                       (RayTrainEnvironment, "Ray Train")])
def test_a_missing_variable_names_its_launcher(environment: type[ClusterEnvironment], launcher: str) -> None:
    with pytest.raises(ConfigurationError, match=f"^WORLD_SIZE is not set although the job looks like it runs"
                                                 f" under {launcher}: start the script through {launcher}"):
        environment().world_size()


# --- SLURM ------------------------------------------------------------------------------------

def set_slurm(monkeypatch: pytest.MonkeyPatch, **overrides: object) -> None:
    values = dict(
        SLURM_NTASKS=8, SLURM_JOB_NAME="train.sh", SLURM_PROCID=6, SLURM_LOCALID=2,
        SLURM_NODEID=1, SLURM_NODELIST="node[03-04]", SLURM_JOB_ID=123456,
        SLURM_NTASKS_PER_NODE=4, SLURM_NNODES=2,
    )  # fmt: skip
    values.update(overrides)
    set_env(monkeypatch, **values)


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("host1,host2", ["host1", "host2"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("a-b[3]", ["a-b3"]),
        ("solo", ["solo"]),
        ("r[1-2]-n[8-9]", ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]),
        ("x[001-002],y[7]", ["x001", "x002", "y7"]),
    ],
)
def test_slurm_hostlist(hostlist: str, expected: list[str]) -> None:
    assert parse_slurm_hostlist(hostlist) == expected


@pytest.mark.parametrize("hostlist", ["node[01-04", "node]1[", "node[a-b]", "n[[1]]", "n[5-3]"])
def test_slurm_hostlist_malformed(hostlist: str) -> None:
    with pytest.raises(ConfigurationError, match="cannot be parsed: export MASTER_ADDR"):
        parse_slurm_hostlist(hostlist)


def test_slurm_detect_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not SLURMEnvironment.detect()
    set_slurm(monkeypatch)
    env = detected(SLURMEnvironment, (6, 2, 1, 8))
    assert env.main_address == "node03"
    assert env.main_port == 15000 + 123456 % 20000 == 18456


@pytest.mark.parametrize("job_name", ["bash", "interactive"])
def test_slurm_interactive_not_detected(monkeypatch: pytest.MonkeyPatch, job_name: str) -> None:
    set_slurm(monkeypatch, SLURM_JOB_NAME=job_name)
    assert not SLURMEnvironment.detect()
    assert isinstance(detect_environment(), LocalEnvironment)


def test_slurm_overrides_and_job_nodelist(monkeypatch: pytest.MonkeyPatch) -> None:
    set_slurm(monkeypatch)
    monkeypatch.delenv("SLURM_NODELIST")
    set_env(monkeypatch, SLURM_JOB_NODELIST="gpu[7,9]")
    env = SLURMEnvironment()
    assert env.main_address == "gpu7"
    set_env(monkeypatch, MASTER_ADDR="10.1.1.1", MASTER_PORT=31000)
    assert (env.main_address, env.main_port) == ("10.1.1.1", 31000)


def test_slurm_missing_nodelist_and_bad_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    set_slurm(monkeypatch, SLURM_JOB_ID="")
    monkeypatch.delenv("SLURM_NODELIST")
    env = SLURMEnvironment()
    with pytest.raises(ConfigurationError, match="SLURM_NODELIST and SLURM_JOB_NODELIST are unset"):
        env.main_address
    with pytest.raises(ConfigurationError, match="export MASTER_PORT"):
        env.main_port


def test_slurm_port_is_same_on_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    set_slurm(monkeypatch, SLURM_NODEID=0, SLURM_PROCID=0)
    first = SLURMEnvironment().main_port
    set_slurm(monkeypatch, SLURM_NODEID=1, SLURM_PROCID=7)
    assert SLURMEnvironment().main_port == first
    set_slurm(monkeypatch, SLURM_JOB_ID=123457)
    assert SLURMEnvironment().main_port == first + 1


def test_slurm_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    set_slurm(monkeypatch)
    assert_validates(SLURMEnvironment(), accepted=(4, 2), refused={
        (2, 2): r"4 tasks per node .*devices=4 or sbatch --ntasks-per-node=2",
        (4, 1): r"allocated 2 nodes .*num_nodes=2 or sbatch --nodes=1",
    })


def test_slurm_validate_total_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    set_slurm(monkeypatch)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    monkeypatch.delenv("SLURM_NNODES")
    assert_validates(SLURMEnvironment(), accepted=(2, 4), refused={(2, 2): r"started 8 tasks .*expects 4"})


def test_slurm_yields_to_mpirun_inside_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    set_slurm(monkeypatch)
    set_env(monkeypatch, OMPI_COMM_WORLD_SIZE=8, OMPI_COMM_WORLD_RANK=3,
            OMPI_COMM_WORLD_LOCAL_RANK=3, OMPI_COMM_WORLD_LOCAL_SIZE=4)  # fmt: skip
    assert not SLURMEnvironment.detect()
    env = detect_environment()
    assert isinstance(env, MPIEnvironment)
    assert env.global_rank() == 3


# --- LSF --------------------------------------------------------------------------------------

def write_rankfile(tmp_path: Path, hosts: list[str]) -> Path:
    path = tmp_path / "rankfile"
    path.write_text("".join(f"{host}\n" for host in hosts))
    return path


def set_lsf(monkeypatch: pytest.MonkeyPatch, rankfile: Path | str, **overrides: object) -> None:
    values = dict(
        LSB_JOBID=4242, LSB_DJOB_RANKFILE=rankfile, JSM_NAMESPACE_RANK=5,
        JSM_NAMESPACE_LOCAL_RANK=1, JSM_NAMESPACE_SIZE=8,
    )  # fmt: skip
    values.update(overrides)
    set_env(monkeypatch, **values)


def test_lsf_detect_and_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert not LSFEnvironment.detect()
    rankfile = write_rankfile(tmp_path, ["batch1", "c1", "c1", "c1", "c1", "c2", "c2", "c2", "c2"])
    set_lsf(monkeypatch, rankfile)
    monkeypatch.setattr(socket, "gethostname", lambda: "c2")
    assert LSFEnvironment.detect()
    env = LSFEnvironment()
    assert env.creates_processes_externally
    assert (env.global_rank(), env.local_rank(), env.world_size()) == (5, 1, 8)
    assert env.compute_hosts() == ["c1", "c2"]
    assert env.node_rank() == 1
    assert env.main_address == "c1"
    assert env.main_port == 15000 + 4242
    set_env(monkeypatch, MASTER_ADDR="10.2.2.2", MASTER_PORT=30001)
    assert (env.main_address, env.main_port) == ("10.2.2.2", 30001)


def test_lsf_detect_needs_all_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    set_lsf(monkeypatch, tmp_path / "rankfile")
    monkeypatch.delenv("JSM_NAMESPACE_LOCAL_RANK")
    assert not LSFEnvironment.detect()


def test_lsf_hostname_ignores_domain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    set_lsf(monkeypatch, write_rankfile(tmp_path, ["batch", "c1.site", "c2.site", "c3.site"]))
    monkeypatch.setattr(socket, "gethostname", lambda: "c3")
    assert LSFEnvironment().node_rank() == 2


def test_lsf_rankfile_read_lazily_and_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rankfile = tmp_path / "later"
    set_lsf(monkeypatch, rankfile)
    env = LSFEnvironment()  # no file yet: constructing and reading ranks must not touch it
    assert env.global_rank() == 5
    write_rankfile(tmp_path, ["batch", "a", "b"]).rename(rankfile)
    assert env.main_address == "a"
    rankfile.unlink()
    assert env.compute_hosts() == ["a", "b"]


def test_lsf_rankfile_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    set_lsf(monkeypatch, tmp_path / "nope")
    expected = r"rank file LSB_DJOB_RANKFILE=.*nope.* cannot be read"
    with pytest.raises(ConfigurationError, match=expected):
        LSFEnvironment().main_address


def test_lsf_rankfile_without_compute_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    set_lsf(monkeypatch, write_rankfile(tmp_path, ["batch"]))
    with pytest.raises(ConfigurationError, match="lists no compute host"):
        LSFEnvironment().main_address


def test_lsf_host_not_in_rankfile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    set_lsf(monkeypatch, write_rankfile(tmp_path, ["batch", "c1", "c2"]))
    monkeypatch.setattr(socket, "gethostname", lambda: "elsewhere")
    with pytest.raises(ConfigurationError, match="'elsewhere' is not among the compute hosts"):
        LSFEnvironment().node_rank()


def test_lsf_validate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    set_lsf(monkeypatch, tmp_path / "rankfile")
    assert_validates(LSFEnvironment(), accepted=(4, 2), refused={(4, 1): r"jsrun started 8 processes .*expects 4"})


# --- MPI --------------------------------------------------------------------------------------

def set_open_mpi(
    monkeypatch: pytest.MonkeyPatch, rank: int, local_rank: int, size: int, local_size: int
) -> None:
    set_env(monkeypatch, OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_LOCAL_RANK=local_rank,
            OMPI_COMM_WORLD_SIZE=size, OMPI_COMM_WORLD_LOCAL_SIZE=local_size)  # fmt: skip


def test_mpi_open_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not MPIEnvironment.detect()
    set_open_mpi(monkeypatch, rank=6, local_rank=2, size=8, local_size=4)
    # Open MPI's NODE_RANK counts processes on the node, not nodes: it must not be used.
    set_env(monkeypatch, OMPI_COMM_WORLD_NODE_RANK=2, MASTER_ADDR="head")
    env = detected(MPIEnvironment, (6, 2, 1, 8))
    assert (env.main_address, env.main_port) == ("head", 29510)
    set_env(monkeypatch, MASTER_PORT=40000)
    assert env.main_port == 40000


def test_mpi_mpich(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, PMI_RANK=3, PMI_SIZE=4, MPI_LOCALRANKID=3, MPI_LOCALNRANKS=4)
    assert MPIEnvironment.detect()
    env = MPIEnvironment()
    assert (env.global_rank(), env.local_rank(), env.node_rank(), env.world_size()) == (3, 3, 0, 4)
    assert env.main_address == "127.0.0.1"  # one node: loopback is safe
    env.validate_settings(num_devices=4, num_nodes=1)


def test_mpi_multi_node_needs_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    set_open_mpi(monkeypatch, rank=0, local_rank=0, size=8, local_size=4)
    expected = r"MASTER_ADDR is not set .*mpirun -x MASTER_ADDR="
    with pytest.raises(ConfigurationError, match=expected):
        MPIEnvironment().main_address


def test_mpi_round_robin_placement_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    set_open_mpi(monkeypatch, rank=1, local_rank=0, size=4, local_size=2)  # --map-by node
    with pytest.raises(ConfigurationError, match="not placed node by node"):
        MPIEnvironment().node_rank()


def test_mpi_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    set_open_mpi(monkeypatch, rank=0, local_rank=0, size=8, local_size=4)
    assert_validates(MPIEnvironment(), accepted=(4, 2), refused={
        (2, 4): r"4 processes per node .*devices=4",
        (4, 3): r"8 processes .*expects 12.*num_nodes=2",
    })


# --- Kubeflow ---------------------------------------------------------------------------------

def set_kubeflow(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, KUBERNETES_PORT="tcp://10.96.0.1:443", MASTER_ADDR="job-master-0",
            MASTER_PORT=23456, WORLD_SIZE=3, RANK=2)  # fmt: skip


def test_kubeflow_detect_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not KubeflowEnvironment.detect()
    set_kubeflow(monkeypatch)
    env = detected(KubeflowEnvironment, (2, 0, 2, 3))
    assert (env.main_address, env.main_port) == ("job-master-0", 23456)


def test_kubeflow_not_detected_off_k8s_or_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kubeflow(monkeypatch)
    monkeypatch.delenv("KUBERNETES_PORT")
    assert not KubeflowEnvironment.detect()
    set_kubeflow(monkeypatch)
    set_env(monkeypatch, TORCHELASTIC_RUN_ID="abc", LOCAL_RANK=0)
    assert not KubeflowEnvironment.detect()
    assert isinstance(detect_environment(), TorchElasticEnvironment)


def test_kubeflow_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kubeflow(monkeypatch)
    assert_validates(KubeflowEnvironment(), accepted=(1, 3), refused={
        (2, 3): r"one process per pod .*devices=2.*set devices=1",
        (1, 2): r"has 3 pods .*num_nodes=3",
    })


# --- detect_environment -----------------------------------------------------------------------

def test_detection_order() -> None:
    assert ENVIRONMENTS == (
        TorchElasticEnvironment, RayTrainEnvironment, SLURMEnvironment, LSFEnvironment,
        MPIEnvironment, KubeflowEnvironment, LocalEnvironment,
    )  # fmt: skip
    assert all(issubclass(cls, ClusterEnvironment) for cls in ENVIRONMENTS)


def test_detect_environment_defaults_to_local() -> None:
    env = detect_environment()
    assert type(env) is LocalEnvironment


def test_torchrun_inside_slurm_picks_torchelastic(monkeypatch: pytest.MonkeyPatch) -> None:
    set_slurm(monkeypatch)
    assert isinstance(detect_environment(), SLURMEnvironment)
    set_torchrun(monkeypatch)
    env = detect_environment()
    assert isinstance(env, TorchElasticEnvironment)
    assert env.global_rank() == 5


def test_slurm_and_lsf_before_mpi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    set_env(monkeypatch, PMI_RANK=0, PMI_SIZE=8)  # srun --mpi=pmi2 exports these too
    set_slurm(monkeypatch)
    assert isinstance(detect_environment(), SLURMEnvironment)
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    set_lsf(monkeypatch, tmp_path / "rankfile")
    set_open_mpi(monkeypatch, rank=5, local_rank=1, size=8, local_size=4)  # Spectrum MPI sets these
    assert isinstance(detect_environment(), LSFEnvironment)


def test_mpi_before_kubeflow(monkeypatch: pytest.MonkeyPatch) -> None:
    set_kubeflow(monkeypatch)
    set_open_mpi(monkeypatch, rank=0, local_rank=0, size=1, local_size=1)
    assert isinstance(detect_environment(), MPIEnvironment)



def test_a_port_lite_chooses_lies_below_the_kernels_ephemeral_range_and_is_free() -> None:
    """Below the range no outgoing connection and no `bind(0)` can take the port before the job's
    store binds it (a port drawn with `bind(0)` was taken so in a loaded CI run)."""
    from lite_core.environments.local import find_free_port

    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {find_free_port() for _ in range(20)}
    assert all(1024 <= port < first_ephemeral for port in ports), (ports, first_ephemeral)
    assert len(ports) > 1  # drawn at random, not one fixed port that every job would contend for
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))  # free
