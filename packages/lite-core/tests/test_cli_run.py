"""`lite run`'s command line, parsed in this process: torchrun's own options with torchrun's
meaning (the agent's `LaunchConfig` they give), Lite's names for them, Lite's choices exported,
and one-sentence errors for what cannot work. Only the rendezvous tests start the agent (no rank
is started: nobody else ever joins)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from lite_core.cli import main
from lite_core.cli._run import launch_config, parse


@pytest.fixture(autouse=True)
def kept_environment(clean_env: None) -> Iterator[None]:
    """`launch_config` exports Lite's choices to os.environ (the ranks inherit them): undo it."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def config_of(*argv: str):
    return launch_config(parse(argv))


def test_the_help_describes_lites_script_not_torchruns_single_gpu_program() -> None:
    from lite_core.cli._run import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "single GPU" not in text
    assert "SCRIPT the Python script every rank runs (with -m, the module), then its arguments" in text


def test_lites_names_mean_the_same_as_torchruns() -> None:
    torchrun = vars(parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29400",
                           "train.py", "--lr", "0.1"]))
    lite = vars(parse(["--num-nodes", "2", "--node-rank", "1", "--main-address", "10.0.0.1", "--main-port", "29400",
                       "train.py", "--lr", "0.1"]))
    underscores = vars(parse(["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port",
                              "29400", "train.py", "--lr", "0.1"]))
    assert torchrun == lite == underscores
    assert lite["training_script_args"] == ["--lr", "0.1"] and lite["nnodes"] == "2:2"


def test_every_torchrun_option_reaches_the_agent(tmp_path) -> None:
    config, entrypoint, args = config_of(
        "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
        "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=5,last_call_timeout=1", "--max-restarts", "3",
        "--monitor-interval", "0.5", "--log-dir", str(tmp_path), "--redirects", "3", "--tee", "1",
        "--local-ranks-filter", "0", "--role", "trainer", "train.py", "--epochs", "2")
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 2, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "127.0.0.1:29400", "job7")
    assert config.rdzv_configs.items() >= {"join_timeout": "5", "last_call_timeout": "1"}.items()
    assert (config.max_restarts, config.monitor_interval, config.role) == (3, 0.5, "trainer")
    specs = config.logs_specs
    assert (specs.root_log_dir, specs._redirects.value, specs._tee.value, specs._local_ranks_filter) == (
        str(tmp_path), 3, 1, {0})
    # Every rank runs the script through Lite's entry module (torch's `record` around it).
    assert entrypoint == sys.executable
    assert args == ["-u", "-m", "lite_core.launchers.rank", "train.py", "--epochs", "2"]


def test_a_module_and_a_program_without_python() -> None:
    _, entrypoint, args = config_of("--nproc-per-node", "2", "-m", "mypkg.train", "--lr", "1")
    assert (entrypoint, args) == (sys.executable, ["-u", "-m", "lite_core.launchers.rank", "-m", "mypkg.train",
                                                   "--lr", "1"])
    _, entrypoint, args = config_of("--no-python", "./train.sh", "fast")
    assert (entrypoint, args) == ("./train.sh", ["fast"])


def test_rendezvous_defaults_are_torchruns() -> None:
    alone, _, _ = config_of("train.py")  # one node, no port: a free port of this machine
    assert (alone.rdzv_backend, alone.rdzv_endpoint) == ("c10d", "localhost:0")
    standalone, _, _ = config_of("--standalone", "train.py")
    assert (standalone.rdzv_backend, standalone.rdzv_endpoint) == ("c10d", "localhost:0")
    static, _, _ = config_of("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "train.py")
    assert (static.rdzv_backend, static.rdzv_endpoint, static.rdzv_configs["rank"]) == ("static", "10.0.0.1:29500", 1)
    # Lite's grace period after SIGTERM, unless --shutdown-timeout says otherwise.
    assert alone.shutdown_timeout == 5
    assert config_of("--shutdown-timeout", "9", "train.py")[0].shutdown_timeout == 9


def test_lites_choices_are_exported_to_the_ranks() -> None:
    config, _, _ = config_of("--accelerator", "cpu", "--strategy", "ddp", "--devices", "2", "--precision", "64-true",
                             "--nnodes", "2", "--master-port", "29400", "train.py")
    assert config.nproc_per_node == 2
    assert {k: os.environ[k] for k in ("LITE_ACCELERATOR", "LITE_STRATEGY", "LITE_DEVICES", "LITE_PRECISION",
                                       "LITE_NUM_NODES")} == {
        "LITE_ACCELERATOR": "cpu", "LITE_STRATEGY": "ddp", "LITE_DEVICES": "2", "LITE_PRECISION": "64-true",
        "LITE_NUM_NODES": "2"}


def test_the_ranks_threads_and_the_cores_they_share(capfd: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    config_of("--accelerator", "cpu", "--devices", "2", "train.py")
    assert os.environ["OMP_NUM_THREADS"] == "1"  # what every Lite launcher gives several ranks, as torch's agent
    assert capfd.readouterr().err == (
        "lite run: each of the 2 ranks on this machine computes on 1 CPU thread (OMP_NUM_THREADS=1, as torchrun sets"
        " it), and 16 cores are usable: export OMP_NUM_THREADS=8 to use them all.\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice: kept, nothing to say
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    config_of("--accelerator", "cpu", "--nproc-per-node", "3", "train.py")
    assert os.environ["OMP_NUM_THREADS"] == "3"
    assert capfd.readouterr().err == (
        "lite run: warning: 3 processes share this machine's 2 usable CPU core(s), so each computes slower than on a"
        " core of its own: start at most 2 (devices=2) for the fastest steps.\n")


def test_an_elastic_node_count_is_left_to_the_agent() -> None:
    config_of("--nnodes", "1:2", "--nproc-per-node", "cpu", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              "127.0.0.1:29400", "train.py")
    assert "LITE_NUM_NODES" not in os.environ  # it changes between restarts: Lite takes the launcher's count
    assert os.environ["LITE_DEVICES"] == str(os.cpu_count())  # torchrun's `cpu`: one process per CPU


def test_only_a_job_that_nodes_can_join_later_turns_off_store_sharing(monkeypatch) -> None:
    from lite_core.launchers.elastic import _rendezvous_environment

    c10d = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400")
    assert _rendezvous_environment(config_of("--nnodes", "1:2", *c10d, "train.py")[0]) == {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert _rendezvous_environment(config_of("--nnodes", "2", *c10d, "train.py")[0])  # a node may come back
    assert _rendezvous_environment(config_of("train.py")[0]) == {}  # one node: nobody joins later
    assert _rendezvous_environment(config_of("--nnodes", "2", "--node-rank", "0", "train.py")[0]) == {}  # static
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # the user's choice stays
    assert _rendezvous_environment(config_of("--nnodes", "1:2", *c10d, "train.py")[0]) == {}


def test_a_script_or_module_that_is_not_there_is_refused_before_any_rank_starts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--devices", "2", "nosuch.py"]) == 2
    assert capsys.readouterr().err == f"lite run: error: SCRIPT nosuch.py is not a file: check the path (relative to {tmp_path}).\n"
    assert main(["run", "-m", "nosuch_pkg.train"]) == 2
    assert capsys.readouterr().err == (
        f"lite run: error: MODULE nosuch_pkg.train is not found from {tmp_path}: check its name, or install its package"
        " (e.g. `pip install -e .`) or run from the folder that holds it.\n")
    (tmp_path / "mine.py").write_text("")  # `python -m mine` finds it here, as the ranks will
    from lite_core.cli._run import check_target_exists

    check_target_exists(parse(["-m", "mine"]))
    check_target_exists(parse(["mine.py"]))


@pytest.mark.parametrize(("argv", "message"), [
    ((), "SCRIPT is missing: name the Python file to run after the options, e.g. `lite run --devices 2 train.py`."),
    (("-m",), "MODULE is missing after -m: name the module to run, e.g. `lite run -m mypkg.train`."),
    (("--max-restarts", "-1", "train.py"), "--max-restarts -1 is negative: pass 0 or more restarts."),
    (("--nnodes", "3:2", "train.py"),
     "--nnodes 3:2 has a minimum above its maximum: pass MIN:MAX with MIN <= MAX, e.g. --nnodes 2:3."),
    (("--nnodes", "two", "train.py"),
     "--nnodes two is not a number of nodes: pass N or MIN:MAX, e.g. --nnodes 2 or --nnodes 1:4."),
    (("--nnodes", "0", "train.py"), "--nnodes 0 asks for no node: pass at least 1, e.g. --nnodes 1:1."),
    (("--nproc-per-node", "0", "train.py"),
     "--nproc-per-node 0 starts no process: pass a number of processes per node (1 or more), or cpu, gpu or auto."),
    (("--nnodes", "1:2", "train.py"),
     "--nnodes 1:2 needs a rendezvous that lets nodes come and go: add --rdzv-backend c10d --rdzv-endpoint"
     " HOST:PORT (the same on every node)."),
    (("--devices", "2", "--nproc-per-node", "2", "train.py"),
     "--devices 2 and --nproc-per-node 2 both give the processes per node: pass only one of them."),
    (("--nnodes", "2", "--node-rank", "2", "train.py"),
     "--node-rank 2 is outside the 2 node(s) of the job: pass a rank from 0 to 1."),
    (("--standalone", "--nnodes", "2", "train.py"),
     "--standalone runs one node on a free port: drop --num-nodes/--nnodes and --main-port/--master-port."),
])
def test_a_bad_command_line_is_refused_in_one_sentence(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                                       message: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")  # a script that is there: the error is the options'
    assert main(["run", *argv]) == 2
    assert capsys.readouterr().err == f"lite run: error: {message}\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("conf", "message"), [
    # is_host=0: this node only joins (on loopback it would otherwise host the endpoint itself).
    ("is_host=0,read_timeout=1",
     "Nobody answered at the rendezvous endpoint {endpoint} before the rendezvous timeout: start the node that hosts"
     " it (node 0, or the host named in --rdzv-endpoint) or fix the address and port on this one."),
    ("join_timeout=1",
     "Fewer than 2 node(s) joined the rendezvous at {endpoint} before its timeout: start every node with the same"
     " --rdzv-endpoint and --rdzv-id, lower the minimum of --nnodes, or raise --rdzv-conf join_timeout=SECONDS."),
], ids=["an-endpoint-nobody-serves", "nodes-that-never-join"])
def test_a_rendezvous_that_fails_is_named_after_its_timeout(capsys, free_tcp_port, conf: str, message: str) -> None:
    endpoint = f"127.0.0.1:{free_tcp_port()}"
    assert main(["run", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-conf", conf, __file__]) == 2
    assert capsys.readouterr().err == f"lite run: error: {message.format(endpoint=endpoint)}\n"
