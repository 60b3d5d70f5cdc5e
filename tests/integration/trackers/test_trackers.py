"""WandbLogger, MLflowLogger and TrackioLogger against their real clients: MLflow's own tracking
server, started here on loopback with a SQLite store and read back through `mlflow.MlflowClient`,
W&B in offline mode, its run files read back with wandb's own datastore reader, and trackio's local
store (a SQLite file per project under TRACKIO_DIR), read back through its `SQLiteStorage`.

One 2-process `lite run --max-restarts 1` job covers one run per job (every rank logs), each step
logged once (the restart repeats a step the server already holds), the hyperparameters and the
artifact; a server killed in the middle of a run covers the outage."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow", reason="needs lite-core[mlflow]: these tests run in the test-trackers environment")
wandb = pytest.importorskip("wandb", reason="needs lite-core[wandb]: these tests run in the test-trackers environment")
# trackio reads TRACKIO_DIR once, when it is imported: this process and the jobs share one store.
TRACKIO_DIR = Path(tempfile.mkdtemp(prefix="lite-trackio-"))
os.environ["TRACKIO_DIR"] = str(TRACKIO_DIR)
trackio = pytest.importorskip("trackio", reason="needs lite-core[trackio]: these tests run in the test-trackers environment")
from trackio.sqlite_storage import SQLiteStorage  # noqa: E402

from conftest import free_port, wandb_history, wandb_records  # noqa: E402  (the repository's conftest.py)
from lite_core import LightningLite, MLflowLogger, TrackioLogger, WandbLogger  # noqa: E402
from lite_core.errors import MisuseError  # noqa: E402

# A hang guard, not a speed check: the job and the servers start in about 30 s on an idle machine.
pytestmark = [pytest.mark.trackers, pytest.mark.timeout(600)]

LITE_RUN = [sys.executable, "-m", "lite_core.cli", "run", "--accelerator", "cpu"]
STEPS = 8


class Server:
    """`mlflow server` on 127.0.0.1 with a SQLite store in `folder`; `stop()` kills it, `start()`
    brings it back on the same port and store."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db",
                   "--artifacts-destination", str(self.folder / "artifacts"), "--host", "127.0.0.1",
                   "--port", str(self.port), "--workers", "1"]
        log = (self.folder / "server.log").open("ab")
        self.proc = subprocess.Popen(command, stdout=log, stderr=log, cwd=self.folder, start_new_session=True)
        deadline = time.monotonic() + 240  # a hang guard: it answers in seconds
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as response:
                    if response.status == 200:
                        # the server that answers is the one just started, not one left on the port
                        assert self.proc.poll() is None, (self.folder / "server.log").read_text()
                        return
            except OSError:
                assert self.proc.poll() is None, (self.folder / "server.log").read_text()
                time.sleep(0.5)
        raise AssertionError(f"mlflow server did not answer: {(self.folder / 'server.log').read_text()}")

    def stop(self) -> None:
        """Kill the server's whole process group (its uvicorn and job workers too) and wait until
        every process of it is gone, so that nothing answers on the port afterwards."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + 60  # a hang guard: the group is gone within milliseconds
        while self.proc is not None and time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module (it starts in seconds alone, in a minute on a busy CI machine)."""
    server = Server(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def wandb_runs(folder: Path) -> list[Path]:
    """The offline run folders under `folder`, oldest first: one per attempt, and one more for each
    checkpoint (the logger finishes the run there and continues it in a new folder)."""
    return sorted(folder.glob("wandb/offline-run-*"))


def wandb_run_id(run_dir: Path) -> str:
    """The run id of an offline run folder (its `run-<id>.wandb` file; the folder's name may end in
    a `-N` that W&B adds when one second saw two folders of the run)."""
    return next(run_dir.glob("run-*.wandb")).stem.removeprefix("run-")


def wandb_steps(runs: list[Path], key: str = "value") -> list[int]:
    """The steps of the rows holding `key`, folder after folder."""
    return [row["_step"] for run in runs for row in wandb_history(run) if key in row]


def wandb_config(run_dir: Path) -> dict:
    """The run's config as its `run` record (`wandb.init(config=...)`) and `config` records set it."""
    updates = {"run": lambda record: record.run.config.update, "config": lambda record: record.config.update}
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for record in wandb_records(run_dir) if record.WhichOneof("record_type") in updates
            for item in updates[record.WhichOneof("record_type")](record) if not item.key.startswith("_")}


@pytest.fixture(scope="module")
def job(server: Server, tmp_path_factory: pytest.TempPathFactory, run_script, output_of) -> tuple[Path, Server]:
    out_dir = tmp_path_factory.mktemp("trackers_job")
    proc = run_script(command=[*LITE_RUN, "--max-restarts", "1", "--nproc-per-node", "2", "--standalone",
                               "trackers_job.py", str(out_dir), server.uri],
                      # Rank 0 alone talks to the trackers (a W&B service starting at the restart's load, the
                      # MLflow server) while rank 1 waits in the next collective: the repository's 20 s guard
                      # was passed once under CI's lanes. 120 s stays a hang guard (a call takes about 1 s idle).
                      env={"WANDB_SILENT": "true", "TRACKIO_DIR": str(TRACKIO_DIR), "LITE_COLLECTIVE_TIMEOUT": "120"},
                      timeout=400)  # a hang guard: about 60 s on an idle machine, 2 W&B services start
    assert proc.returncode == 0, output_of(proc)
    assert (out_dir / "died").exists()  # rank 1 died once, and the restart finished the job
    return out_dir, server


def test_mlflow_holds_one_run_with_each_step_once_the_config_and_rank_zeros_artifact(job) -> None:
    out_dir, server = job
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    experiment = client.get_experiment_by_name("lite-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # not one per rank, not one per attempt
    run = runs[0]
    assert history(client, run.info.run_id, "value") == [(s, float(s)) for s in range(STEPS)]  # rank 0's, once each
    assert run.data.params == {"lr": "0.05", "optimizer.name": "sgd", "optimizer.momentum": "0.0"}
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["summary-rank0.txt"]
    assert run.info.status == "FINISHED"
    assert not list(out_dir.glob("mlflow-unsent-*"))


def test_the_monitors_rows_the_checkpoints_stall_and_the_restart_reach_mlflow_once_each(job) -> None:
    _, server = job
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    [run] = client.search_runs([client.get_experiment_by_name("lite-test").experiment_id])
    run_id = run.info.run_id
    assert [step for step, _ in history(client, run_id, "throughput/samples_per_sec")] == [2, 4, 6]
    # A save after steps 1 and 3 (first attempt) and 5 (after the restart, whose monitor starts anew).
    assert history(client, run_id, "checkpoint/saves") == [(2, 1.0), (4, 1.0), (6, 1.0)]
    stalls = dict(history(client, run_id, "checkpoint/stall_seconds"))
    assert sorted(stalls) == [2, 4, 6] and all(seconds > 0 for seconds in stalls.values())
    # The restart is on the dashboard: rows of the second attempt say one restart before it.
    assert history(client, run_id, "fault/restarts") == [(2, 0.0), (4, 0.0), (6, 1.0)]


def test_wandb_continues_one_run_across_the_restart_with_the_config_and_rank_zeros_file(job) -> None:
    out_dir, _ = job
    runs = wandb_runs(out_dir / "wandb")
    # A folder per attempt and per checkpoint (at steps 1 and 3, then 5 and 7 after the restart) ...
    assert len(runs) == 6, runs
    assert len({wandb_run_id(run) for run in runs}) == 1, runs  # ... of one run id, which sync joins
    values = [row["value"] for run in runs for row in wandb_history(run) if "value" in row]
    # The first attempt logged steps 0..4; the restart resumed from the checkpoint of step 3.
    # Offline, W&B cannot tell that step 4 was logged after that checkpoint (see docs/logging.md).
    assert wandb_steps(runs) == [0, 1, 2, 3, 4, 4, 5, 6, 7]
    assert set(values) == {float(s) for s in range(STEPS)}  # rank 0's values only
    # The ThroughputMonitor's rows, with the checkpoints' stall (each attempt's monitor from its third step).
    assert wandb_steps(runs, "checkpoint/saves") == [2, 4, 6]
    for run in runs:
        assert wandb_config(run) == {"lr": 0.05, "optimizer": {"name": "sgd", "momentum": 0.0}}
    assert sorted(p.name for run in runs for p in (run / "files").glob("summary-rank*")) == ["summary-rank0.txt"]


def trackio_steps(run: str, key: str = "value", project: str = "lite-test") -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in SQLiteStorage.get_logs(project, run) if key in row]


def test_trackio_continues_one_run_with_each_step_once_the_config_and_rank_zeros_artifact(job) -> None:
    assert trackio.utils.TRACKIO_DIR == TRACKIO_DIR  # the store this module set, not the user's
    [run] = SQLiteStorage.get_runs("lite-test")  # not one per rank, not one per attempt
    # The restart resumed from the checkpoint of step 3; the store held step 4 already, so it was skipped.
    assert trackio_steps(run) == [(s, float(s)) for s in range(STEPS)]  # rank 0's, once each
    assert trackio_steps(run, "fault/restarts") == [(2, 0.0), (4, 0.0), (6, 1.0)]  # the monitor's rows
    config = SQLiteStorage.get_run_config("lite-test", run)
    assert {k: v for k, v in config.items() if not k.startswith("_")} == {
        "lr": 0.05, "optimizer": {"name": "sgd", "momentum": 0.0}}
    artifacts = SQLiteStorage.get_run_artifacts("lite-test", run, None)["output"]
    assert [a["name"] for a in artifacts] == ["summary-rank0.txt"], artifacts


@pytest.fixture(scope="module")
def resized_job(server: Server, tmp_path_factory: pytest.TempPathFactory, run_script,
                output_of) -> tuple[Path, Path]:
    """The job preempted on 2 processes, then resumed by a new `lite run` on 1 process in another
    folder, as on another machine after a preemption or on the node an elastic scale-down keeps:
    only the checkpoint travels."""
    first, second = tmp_path_factory.mktemp("on_two"), tmp_path_factory.mktemp("on_one")
    env = {"WANDB_SILENT": "true", "TRACKIO_DIR": str(TRACKIO_DIR)}
    def job_on(processes: int, out_dir: Path) -> list[str]:
        return [*LITE_RUN, "--nproc-per-node", str(processes), "--standalone", "trackers_job.py", str(out_dir),
                server.uri, "resized"]

    proc = run_script(command=job_on(2, first), env=env, timeout=400)
    assert proc.returncode != 0 and (first / "died").exists(), output_of(proc)  # preempted at step 4
    for name in ("last.ckpt", "died"):
        (shutil.copytree if (first / name).is_dir() else shutil.copy2)(first / name, second / name)
    proc = run_script(command=job_on(1, second), env=env, timeout=400)
    assert proc.returncode == 0, output_of(proc)
    return first, second


def test_a_job_resumed_elsewhere_at_a_smaller_world_size_continues_each_trackers_run(resized_job, server) -> None:
    first, second = resized_job
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    [run] = client.search_runs([client.get_experiment_by_name("resized").experiment_id])
    assert history(client, run.info.run_id, "value") == [(s, float(s)) for s in range(STEPS)]
    [trackio_run] = SQLiteStorage.get_runs("resized")
    assert trackio_steps(trackio_run, project="resized") == [(s, float(s)) for s in range(STEPS)]
    runs = [*wandb_runs(first / "wandb"), *wandb_runs(second / "wandb")]
    assert len({wandb_run_id(run) for run in runs}) == 1, runs  # one run id, which sync joins
    assert wandb_steps(runs) == [0, 1, 2, 3, 4, 4, 5, 6, 7]  # offline, step 4 (after the checkpoint) is there twice


def test_trackio_refuses_the_config_after_the_first_value_and_keeps_it_across_a_resume() -> None:
    logger = TrackioLogger(project="config")
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"value": 0.0}, step=0)
    with pytest.raises(MisuseError, match=r"^TrackioLogger sends the config with the run's first value, which was"
                                          r" already logged: call log_hyperparams before the first log.$"):
        logger.log_hyperparams({"lr": 0.2})
    state = logger.state_dict()
    logger.finalize()
    resumed = TrackioLogger(project="config")  # a resumed job that does not log its config again
    resumed.load_state_dict(state)
    resumed.log_metrics({"value": 1.0}, step=1)
    resumed.finalize()
    assert SQLiteStorage.get_runs("config") == [logger.run_id] == [resumed.run_id]
    assert trackio_steps(logger.run_id, project="config") == [(0, 0.0), (1, 1.0)]
    assert SQLiteStorage.get_run_config("config", logger.run_id)["lr"] == 0.1


def _take_turns(first, second, third) -> None:
    """The loggers of three processes of one job, as under `ddp_ft` when the logging group dies, the
    next one takes over and the first comes back restarted: `first` logs steps 0..2, `second` 3..5,
    `third` 6..7 (Lite calls `log_metrics` where the strategy says a process logs, and `_hand_over`
    elsewhere)."""
    loggers = (first, second, third)
    leader = {"index": 0}
    for index, logger in enumerate(loggers):
        logger._follow(lambda index=index: leader["index"] == index)
    for index, steps in enumerate((range(0, 3), range(3, 6), range(6, 8))):
        leader["index"] = index
        for step in steps:
            for other in loggers:
                if other is not loggers[index]:
                    other._hand_over()
            loggers[index].log_metrics({"value": float(step)}, step=step)
    for logger in loggers:
        logger.finalize()


def test_with_a_job_id_the_process_that_takes_over_continues_the_jobs_mlflow_run(server, tmp_path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setenv("LITE_JOB_ID", "takeover")
    first, second, third = (MLflowLogger(experiment_name="takeover", tracking_uri=server.uri, flush_every=1,
                                         fallback_dir=tmp_path) for _ in range(3))
    for logger in (first, second, third):  # every group's rank 0 keeps the config for the run it may take over
        logger.log_hyperparams({"lr": 0.1})
    _take_turns(first, second, third)
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    [run] = client.search_runs([client.get_experiment_by_name("takeover").experiment_id])
    assert first.run_id == second.run_id == third.run_id == run.info.run_id
    assert history(client, run.info.run_id, "value") == [(s, float(s)) for s in range(8)]
    assert run.data.tags["lite.job"].startswith("lite-") and run.data.params == {"lr": "0.1"}
    assert not list(tmp_path.glob("mlflow-unsent-*"))


def test_with_a_job_id_the_process_that_takes_over_continues_the_jobs_wandb_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LITE_JOB_ID", "takeover")
    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers = [WandbLogger(project="takeover", save_dir=tmp_path / name, mode="offline") for name in "abc"]
    _take_turns(*loggers)
    # The three processes have ended: W&B's service writes the last records of a finished offline
    # run to its file only when it stops (seen under load: the third run's rows were not there yet).
    wandb.teardown()
    runs = [run for name in "abc" for run in wandb_runs(tmp_path / name)]
    assert len(runs) == 3, runs
    assert len({wandb_run_id(run) for run in runs}) == 1, runs  # one run id, which sync joins
    steps = sorted(row["_step"] for run in runs for row in wandb_history(run) if "value" in row)
    assert steps == list(range(8))


def _logging_moves_at_a_sync(first, second) -> None:
    """Two replica groups' loggers under DiLoCo, whose logging group changes only at a sync (a
    round): `first` logs (value = step) in round 0 (steps 0, 1) and round 1 (steps 2, 3), where
    `second` logs too (value = step + 0.5: its share of the batch) and is not sent; `first` dies
    after step 3 (its saves stored what it logged), `second` trains steps 4 and 5 alone, still in
    round 1, and leads from round 2 (step 6) on. Lite calls `log_metrics` on every group's rank 0."""
    moment = {"round": 0, "leader": 0}
    for index, logger in enumerate((first, second)):
        logger._follow(lambda index=index: moment["leader"] == index, lambda: moment["round"])
    for step in range(7):
        moment["round"] = 0 if step < 2 else 1 if step < 6 else 2
        moment["leader"] = 1 if step >= 6 else 0
        if step < 4:
            first.log_metrics({"value": float(step)}, step=step)
        second.log_metrics({"value": step + 0.5}, step=step)
        if step == 3:
            first.finalize()  # then killed
    second.finalize()


#: What the tracker holds when the logging moved at a sync: the dead leader's steps, then the steps
#: it never logged from the group that took over (kept since the round began), then that group's.
MOVED = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5), (6, 6.5)]


def test_when_the_logging_moves_at_a_sync_the_steps_since_the_last_one_reach_trackio(monkeypatch) -> None:
    monkeypatch.setenv("LITE_JOB_ID", "moves-trackio")
    first, second = TrackioLogger(project="moves"), TrackioLogger(project="moves")
    _logging_moves_at_a_sync(first, second)
    assert first.run_id == second.run_id
    assert trackio_steps(first.run_id, project="moves") == MOVED


def test_when_the_logging_moves_at_a_sync_the_steps_since_the_last_one_reach_mlflow(server, tmp_path,
                                                                                   monkeypatch) -> None:
    monkeypatch.setenv("LITE_JOB_ID", "moves-mlflow")
    first, second = (MLflowLogger(experiment_name="moves", tracking_uri=server.uri, fallback_dir=tmp_path)
                     for _ in range(2))
    _logging_moves_at_a_sync(first, second)
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    [run] = client.search_runs([client.get_experiment_by_name("moves").experiment_id])
    assert history(client, run.info.run_id, "value") == MOVED


def test_when_the_logging_moves_at_a_sync_the_steps_since_the_last_one_reach_wandb(tmp_path, monkeypatch) -> None:
    """Offline, W&B cannot say which steps the run holds: the group that takes over writes every
    step it kept since the round began, and `wandb sync` keeps a step's first row (the dead
    leader's folders come first); what an earlier round kept was dropped at the next one."""
    monkeypatch.setenv("LITE_JOB_ID", "moves-wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first, second = (WandbLogger(project="moves", save_dir=tmp_path / name, mode="offline") for name in "ab")
    _logging_moves_at_a_sync(first, second)
    wandb.teardown()  # the offline service writes a run's last records when it stops
    rows = {name: [(row["_step"], row["value"]) for run in wandb_runs(tmp_path / name)
                   for row in wandb_history(run) if "value" in row] for name in "ab"}
    assert rows["a"] == MOVED[:4]
    assert rows["b"] == [(2, 2.5), (3, 3.5), *MOVED[4:]], rows  # not 0 and 1: round 0 had a live leader


AFTER_FINALIZE = (r"^{name}.{call} was called after finalize\(\), which finished the run: log before run\(\)"
                  r" returns \(Lite finalizes its loggers then\), or start another run\(\) to continue the run.$")


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("make", [
    lambda tmp: WandbLogger(project="after", save_dir=tmp, mode="offline"),
    lambda tmp: MLflowLogger(experiment_name="after", tracking_uri=f"http://127.0.0.1:{free_port()}", fallback_dir=tmp),
    lambda tmp: TrackioLogger(project="after"),
], ids=["wandb", "mlflow", "trackio"])
def test_what_is_logged_after_finalize_is_refused_on_every_rank(make, rank, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = make(tmp_path)
    logger.finalize()
    calls = {"log_metrics": lambda: logger.log_metrics({"value": 1.0}, step=1),
             "log_hyperparams": lambda: logger.log_hyperparams({"lr": 0.1}),
             "log_artifact": lambda: logger.log_artifact(__file__)}
    for call, log in calls.items():
        with pytest.raises(MisuseError, match=AFTER_FINALIZE.format(name=type(logger).__name__, call=call)):
            log()
    assert logger.run_id is None  # nothing was opened


def test_a_log_after_the_run_returns_is_refused_and_a_second_run_continues_the_same_runs(server, tmp_path) -> None:
    mlflow_logger = MLflowLogger(experiment_name="again", tracking_uri=server.uri, fallback_dir=tmp_path)
    trackio_logger = TrackioLogger(project="again")
    lite = LightningLite(accelerator="cpu", loggers=[mlflow_logger, trackio_logger])
    lite.launch(lambda lite: lite.log("value", 0.0, step=0))  # Lite finalizes its loggers when it returns
    with pytest.raises(MisuseError, match=AFTER_FINALIZE.format(name="MLflowLogger", call="log_metrics")):
        lite.log("value", 1.0, step=1)
    lite.launch(lambda lite: lite.log("value", 1.0, step=1))
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    [run] = client.search_runs([client.get_experiment_by_name("again").experiment_id])
    assert history(client, run.info.run_id, "value") == [(0, 0.0), (1, 1.0)]
    assert run.info.status == "FINISHED"
    assert SQLiteStorage.get_runs("again") == [trackio_logger.run_id]
    assert trackio_steps(trackio_logger.run_id, project="again") == [(0, 0.0), (1, 1.0)]


def test_what_a_server_down_at_finalize_did_not_take_is_written_to_the_fallback_file(tmp_path, recwarn) -> None:
    logger = MLflowLogger(tracking_uri=f"http://127.0.0.1:{free_port()}", flush_every=2, fallback_dir=tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    for step in range(3):
        logger.log_metrics({"value": float(step)}, step=step)
    logger.finalize()  # no server ever answered: no run, everything in the file
    kept = [json.loads(line) for line in (tmp_path / "mlflow-unsent-no-run.jsonl").read_text().splitlines()]
    assert kept[0] == {"param": "lr", "value": "0.1"}
    assert [(r["metric"], r["step"], r["value"]) for r in kept[1:]] == [("value", s, float(s)) for s in range(3)]
    messages = [str(w.message) for w in recwarn.list if "MLflowLogger" in str(w.message)]
    assert len(messages) == 2 and messages[1] == (
        f"MLflowLogger could not send 3 metric values to '{logger._uri()}': they are in"
        f" '{tmp_path / 'mlflow-unsent-no-run.jsonl'}', one JSON object per line.")


#: What the checkpoint at step 10 covers (logged by the killed job), and what the resumed job logs
#: (kill_after_checkpoint.py): (step, value, attempt).
COVERED = [(step, float(step), 0.0) for step in range(11)]
RESUMED = [(step, step + 1000.0, 1.0) for step in range(11, 16)]


def check_wandb_after_the_kill(out_dir: Path, server: Server) -> None:
    runs = wandb_runs(out_dir / "wandb")
    assert len({wandb_run_id(run) for run in runs}) == 1, runs
    rows = [(row["_step"], row["value"], row["attempt"]) for run in runs for row in wandb_history(run)
            if "value" in row]  # `attempt` was logged in a second call: one row per step holds both
    assert [row for row in rows if row[2] == 0.0 and row[0] <= 10] == COVERED, rows  # none lost, none twice
    assert [row for row in rows if row[2] == 1.0] == RESUMED, rows


def check_trackio_after_the_kill(out_dir: Path, server: Server) -> None:
    [run] = SQLiteStorage.get_runs("kill")
    stored = trackio_steps(run, project="kill")
    assert [step for step, _ in stored] == list(range(16)), stored  # each step once
    # Steps 11 and 12 are the killed job's if its writer thread stored them in time (the resume skips them then).
    assert stored[:11] == [row[:2] for row in COVERED] and stored[13:] == [row[:2] for row in RESUMED[2:]], stored


def check_mlflow_after_the_kill(out_dir: Path, server: Server) -> None:
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    [run] = client.search_runs([client.get_experiment_by_name("kill").experiment_id])
    assert history(client, run.info.run_id, "value") == [row[:2] for row in COVERED + RESUMED]
    assert history(client, run.info.run_id, "attempt") == [(step, attempt) for step, _, attempt in COVERED + RESUMED]


@pytest.mark.parametrize("tracker", ["wandb", "trackio", "mlflow"])
def test_a_job_killed_two_steps_after_a_checkpoint_keeps_every_step_it_covers(tracker, server, tmp_path,
                                                                             run_script, output_of) -> None:
    """The job logs steps 0..12 to one tracker (alone: nothing else delays the kill), saves its logger
    at step 10 and is SIGKILLed after step 12, nothing finalized; resumed from the checkpoint, it logs
    11..15 (kill_after_checkpoint.py)."""
    logger = f"mlflow={server.uri}" if tracker == "mlflow" else tracker
    env = {"WANDB_SILENT": "true", "TRACKIO_DIR": str(TRACKIO_DIR)}
    killed = run_script("kill_after_checkpoint.py", str(tmp_path), logger, env=env, timeout=300)  # a hang guard
    assert killed.returncode == -signal.SIGKILL, output_of(killed)
    resumed = run_script("kill_after_checkpoint.py", str(tmp_path), logger, env=env, timeout=300)
    assert resumed.returncode == 0, output_of(resumed)
    {"wandb": check_wandb_after_the_kill, "trackio": check_trackio_after_the_kill,
     "mlflow": check_mlflow_after_the_kill}[tracker](tmp_path, server)


def test_wandb_refuses_in_one_warning_values_for_a_step_a_checkpoint_already_wrote(tmp_path, monkeypatch,
                                                                                   recwarn) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="late", save_dir=tmp_path, mode="offline")
    lite = LightningLite(accelerator="cpu", loggers=logger)
    lite.log("value", 0.0, step=0)
    lite.save({"wandb": logger}, tmp_path / "last.ckpt")  # writes step 0 to the run
    lite.log("late", 1.0, step=0)
    lite.log("late", 2.0, step=0)
    lite.log("value", 1.0, step=1)
    logger.finalize()
    wandb.teardown()  # W&B's service writes the finished run's last records when it stops
    messages = [str(w.message) for w in recwarn.list if "WandbLogger" in str(w.message)]
    assert messages == ["WandbLogger did not log values for step 0 because a checkpoint had already written that step"
                        " to the run, and W&B takes no values for a step it has moved past: log a step's values before"
                        " you save the checkpoint that covers it."]
    rows = [row for run in wandb_runs(tmp_path) for row in wandb_history(run)]
    assert [(row["_step"], row.get("value"), row.get("late")) for row in rows] == [(0, 0.0, None), (1, 1.0, None)]


def test_mlflow_opens_its_run_at_the_first_value(server, tmp_path) -> None:
    logger = MLflowLogger(experiment_name="first-value", tracking_uri=server.uri, fallback_dir=tmp_path)
    lite = LightningLite(accelerator="cpu", loggers=logger)  # flush_every=20, the default
    lite.log_hyperparams({"lr": 0.1})
    lite.log("value", 0.5, step=0)
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    [run] = client.search_runs([client.get_experiment_by_name("first-value").experiment_id])
    assert logger.run_id == run.info.run_id  # not None for 19 more steps
    assert history(client, run.info.run_id, "value") == [(0, 0.5)] and run.data.params == {"lr": "0.1"}
    logger.finalize()


def test_a_tracking_server_nobody_listens_on_is_reported_at_the_first_value(tmp_path, recwarn) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    logger = MLflowLogger(tracking_uri=uri, fallback_dir=tmp_path)  # flush_every=20, the default
    lite = LightningLite(accelerator="cpu", loggers=logger)
    lite.log("value", 0.5, step=0)
    messages = [str(w.message) for w in recwarn.list if "MLflowLogger" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith(f"MLflowLogger could not reach the tracking server '{uri}'")
    lite.log("value", 1.0, step=1)  # training goes on, with no second warning
    assert len([w for w in recwarn.list if "MLflowLogger" in str(w.message)]) == 1
    logger.finalize()


# Last in the module: it kills the module's server, and starts it again.
def test_an_mlflow_server_down_in_the_middle_of_a_run_loses_no_metric(server, tmp_path, recwarn) -> None:
    logger = MLflowLogger(experiment_name="outage", tracking_uri=server.uri, flush_every=2, fallback_dir=tmp_path)
    lite = LightningLite(accelerator="cpu", loggers=logger)
    lite.log_hyperparams({"lr": 0.1})
    for step in range(4):
        lite.log("value", float(step), step=step)
    server.stop()
    for step in range(4, 8):  # every flush fails: one warning, no error
        lite.log("value", float(step), step=step)
    outage = [str(w.message) for w in recwarn.list if "MLflowLogger" in str(w.message)]
    assert len(outage) == 1 and outage[0].startswith(f"MLflowLogger could not reach the tracking server '{server.uri}'")
    assert outage[0].endswith("training goes on and the values are kept until it answers.")
    server.start()
    lite.log("value", 8.0, step=8)
    lite.log("value", 9.0, step=9)  # the flush that reaches the server sends steps 4..9
    logger.finalize()
    assert not list(tmp_path.glob("mlflow-unsent-*"))
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    assert history(client, logger.run_id, "value") == [(s, float(s)) for s in range(10)]
    assert client.get_run(logger.run_id).data.params == {"lr": "0.1"}
