"""The chaos harness: two replica groups of scripts/chaos_job.py under a seeded schedule of faults,
and the checks a cloud user's job must pass afterwards. The job streams a Hugging Face dataset from
the S3 server (`write_stream` puts its files there), saves to the same server, and logs to trackio,
an MLflow tracking server (`MLflowServer`, on 127.0.0.1) and a W&B offline run. Used by
test_chaos.py (three runs in CI) and by benchmarks/chaos_soak.py (a longer soak: `--faults N --seed S`).

A schedule is drawn from a seed and printed, so a failure replays with the same seed. Each fault
lands between two steps (the groups are held there, see chaos_job.py), so what happened is known
exactly:

- `kill-group`: SIGKILL of one group; the other goes on alone for a few steps, then the killed one
  is started again and heals from it;
- `kill-job`: SIGKILL of both groups (a lost job); both start again from the bucket's latest
  checkpoint;
- `preempt-job`: SIGTERM to both (a spot reclaim); each saves in the foreground at its next step
  and returns; both start again from that checkpoint;
- `store-down`: the S3 server stops; the groups fail at their next save (the first group uploads;
  the other takes over and fails too), the server comes back, both start again;
- `slow-group`: one group sleeps 10 times longer between steps for the rest of the run;
- `tracker-down`: the MLflow server stops; both groups train two steps (their saves cannot send
  the buffered values, which `MLflowLogger` keeps), the server comes back, and both train one more
  step, whose save sends them, before the next fault.

Afterwards (`check`): every epoch trained each sample exactly once (the job's ledger: steps that
were trained again after a rollback to the last checkpoint count once, and must have taken the
same batch), each tracker (trackio, MLflow, W&B) holds one run with every step once and the
value the ledger says (`_check_tracker`, `_check_mlflow`, `_check_wandb`), no group warned that
its loader's position was lost, the groups' weights are equal and equal to one plain process's
reading the same stream to 1e-5, the last checkpoint is the last step's and loads with
`weights_only`, no temporary upload is left in the bucket, and once both groups finished no process
of the job is left running, nor any it started (found by the job's environment: a W&B service runs
in a session of its own); checked before the harness's clean-up kills what is left.
`CHAOS_PLANT=orphan` (each group's process starts a process in a session of its own) was seen to
fail it with "processes of the job still run after both groups finished" (seed 7); the check before
this one ran after the clean-up and looked at the groups' own processes only, so it could not fail.

A second configuration, `diloco` (`CHAOS_STRATEGY=diloco` in the job; `config="diloco"` here), runs
the same job under `DiLoCoStrategy(sync_every=4)`: the groups train alone and meet every 4 inner
steps, each group saving under its own folder of the bucket. Every check above holds unchanged
(each group's last checkpoint is step 24's), except the weights': under DiLoCo they are not one
plain process's, so they are compared, to 1e-6, with the one-process simulation of what actually
happened (`chaos_job.replay`, from the ledgers and the groups' records of their syncs, heals and
loaded checkpoints); where a group healed, the weights must also be far (above 1e-3) from the
same job's simulation without faults, so that the comparison is seen to see the heal. Per fault
kind, under diloco:

- `kill-group` (either group; killing group 0 also kills the logging group, so the logging moves
  to the survivor at its next sync, and the survivor sends the steps it kept since the last one
  that the trackers lack, see docs/logging.md; a group that heals logs the job's step it jumped to):
  the victim starts again from its own last checkpoint. If the survivor has not reached a sync
  meanwhile (its steps alone stop short of one), both meet at the next sync and nothing is lost:
  the simulation is the run without faults. If the survivor synced alone, the victim's half of the
  steps since the last sync of both is lost (its own work died with it; the steps after its
  checkpoint it trains again but a heal throws them away), the survivor trains whole batches from
  its lone sync, and the victim, asking for a quorum at its own next sync, waits for the survivor's
  next one and heals there (weights, inner and outer optimizer, weights of the last sync, loader
  position, step): the simulation follows exactly that, and the ledger still holds each sample once
  per epoch, since the victim's second life trains the half the survivor did not. The harness holds
  the survivor until the victim has asked for its first quorum (released earlier, the survivor could
  end the job before the victim's first sync, and the victim would then train alone to the end,
  logging those steps again: seen once with group 0 killed), and waits for the heal before the next
  fault (until then a hold could stop the survivor short of the sync the victim waits in);
- `kill-job`, `preempt-job`, `store-down`: every group rolls back to its own last checkpoint (which
  may be one step apart between the groups: the odd steps save in the background); the simulation
  loads the same group's state after that step. When those checkpoints stand on either side of a
  sync (the group behind lost its save of the sync step), the group behind waits in its own sync
  until its peer's next one and heals there: its share of the steps between is trained by no group
  (`Report.samples_skipped`, which CI's runs require to be 0 and the soak reports), and the peer's
  logged values of them come with the heal. A hold for the next fault moves to that sync of the
  peer (`ChaosJob._reachable`): held before it, the peer would never come, and the group behind
  would give up its quorum and train on alone (two logging groups).
- `slow-group`, `tracker-down`: nothing changes in the math; the simulation is the run without faults.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

# The repository's conftest.py (test_chaos and the soak put it on the path): the MLflow server and the
# trackers' checks are shared with tests/integration/elastic/test_chaos_nodes.py.
from conftest import MLflowServer, check_mlflow_run, check_trackio_run, check_wandb_run, start_life  # noqa: F401

SCRIPT = Path(__file__).parent / "scripts" / "chaos_job.py"
STEPS = 24  # chaos_job: 2 epochs of 12 global batches
STEPS_PER_EPOCH = 12
SAMPLES = 48
BATCH = 4
KINDS = ("kill-group", "kill-job", "preempt-job", "store-down", "slow-group", "tracker-down")
CONFIGS = ("ddp_ft", "diloco")  # the job's strategy (module docstring)
DILOCO_SYNC_EVERY = 4  # chaos_job.py's SYNC_EVERY
MLFLOW_DOWN_STEPS = 2  # tracker-down: steps trained (and saved) while the MLflow server is stopped
#: Seconds a group may take for anything the harness waits on: a hang guard, far above the idle time
#: (a group's start, the slowest wait, takes about 10 s idle; 120 s was passed once at a load of 12).
PATIENCE = 240.0


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # the step after which it lands (both groups held there)
    group: int = 0  # the victim, for kill-group and slow-group
    alone: int = 0  # kill-group: steps the survivor trains alone before the victim is back

    def __str__(self) -> str:
        victim = f" group {self.group}" if self.kind in ("kill-group", "slow-group") else ""
        alone = f", {self.alone} steps alone" if self.kind == "kill-group" else ""
        return f"{self.kind}{victim} after step {self.step}{alone}"


def draw(seed: int, faults: int = 3) -> list[Fault]:
    """A schedule of `faults` faults at distinct steps, in step order (either configuration)."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, STEPS - 4), faults))
    schedule = []
    for step in steps:
        kind = rng.choice(KINDS)
        group = rng.randrange(2)
        schedule.append(Fault(kind, step, group=group, alone=rng.randrange(1, 4)))
    return schedule


def stream_url(bucket: str) -> str:
    """Where the job's stream lies: a folder beside the checkpoints' (`s3://B/chaos` -> `s3://B/stream`)."""
    return bucket.rstrip("/").rsplit("/", 1)[0] + "/stream"


def write_stream(url: str) -> None:
    """The job's data as 4 JSON-lines files of 12 rows `{"id", "x", "y"}` under `url` (S3 through
    fsspec: the caller's environment points the client at the server)."""
    import fsspec

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 3, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1
    rows = [json.dumps({"id": i, "x": x[i].tolist(), "y": float(y[i])}) for i in range(SAMPLES)]
    part = SAMPLES // 4
    for index in range(4):
        with fsspec.open(f"{url}/part-{index}.jsonl", "w") as file:
            file.write("\n".join(rows[index * part:(index + 1) * part]) + "\n")


@dataclasses.dataclass
class Report:
    """What a run saw: the schedule, the steps trained again, the samples trained more than once
    per epoch (0 when it passes), the samples no group trained because a diloco group healed past
    its share of them (`_skipped_steps`), the steps W&B's offline files hold with two values (see
    `_check_wandb`), the heals of a group from its peer at a sync (diloco), and the seconds the run took."""

    schedule: list[Fault]
    config: str = "ddp_ft"
    heals: int = 0
    steps_trained_again: int = 0
    samples_repeated: int = 0
    samples_skipped: int = 0
    wandb_steps_twice: int = 0
    seconds: float = 0.0


#: The line torchft's manager logs as it asks the lighthouse for a quorum.
_QUORUM_REQUEST = b"All workers joined - starting quorum"


class ChaosJob:
    """The two groups of one run, in folder `out`, meeting at `lighthouse`, saving under `bucket`."""

    def __init__(self, out: Path, lighthouse: str, bucket: str, server: Any, env: Callable[..., dict[str, str]],
                 free_port: Callable[[], int], mlflow: MLflowServer, config: str = "ddp_ft") -> None:
        self.out, self.lighthouse, self.bucket, self.server, self.mlflow = out, lighthouse, bucket, server, mlflow
        self.config = config
        self._env, self._free_port = env, free_port
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self._log_read: dict[int, tuple[int, int]] = {}  # group -> (bytes read, quorum requests seen)

    # -- processes --------------------------------------------------------------------------------
    def start(self, groups: tuple[int, ...] = (0, 1)) -> None:
        """Start `groups` behind the gate and open it once each is ready (so they meet together)."""
        (self.out / "gate").touch()
        for group in groups:
            env = self._env(LITE_COLLECTIVE_TIMEOUT="20", REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2",
                            TORCHFT_LIGHTHOUSE=self.lighthouse, MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(self._free_port()), **job_env(self.out, self.bucket, self.server,
                                                                           self.mlflow, self.config))
            log = (self.out / f"group-{group}.log").open("a")
            self.procs[group] = start_life([sys.executable, str(SCRIPT), str(self.out), self.bucket], env, stdout=log,
                                           stderr=subprocess.STDOUT)
        for group in groups:
            proc = self.procs[group]
            self._wait(lambda: any(self.out.glob(f"ready-{group}-{proc.life}")), f"group {group} to be ready", group)
        (self.out / "gate").unlink()

    def log(self, group: int) -> str:
        path = self.out / f"group-{group}.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def _wait(self, condition: Callable[[], bool], what: str, group: int | None = None,
              alive: bool = True) -> None:
        deadline = time.monotonic() + PATIENCE
        while not condition():
            if alive:
                for g, proc in self.procs.items():
                    if (group is None or g == group) and proc.poll() is not None and not condition():
                        raise AssertionError(f"group {g} ended while waiting for {what}:\n{self.log(g)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {PATIENCE:.0f} s for {what}:\n{self.log(0)}\n{self.log(1)}")
            time.sleep(0.02)

    def _quorum_requests(self, group: int) -> int:
        """How many quorums `group`'s processes have asked the lighthouse for (torchft's manager logs
        this line as it sends the request). Reads only the whole lines the log gained since the last call."""
        path = self.out / f"group-{group}.log"
        if not path.exists():
            return 0
        read, seen = self._log_read.get(group, (0, 0))
        with path.open("rb") as log:
            log.seek(read)
            new = log.read()
        whole = new[:new.rfind(b"\n") + 1]  # a line still being written is read with the next call
        self._log_read[group] = (read + len(whole), seen + whole.count(_QUORUM_REQUEST))
        return self._log_read[group][1]

    def committed(self, group: int) -> int:
        """The last step `group`'s current process recorded (0 before its first)."""
        proc = self.procs[group]
        steps = [step for _, step, pid, _ in ledger(self.out, group) if pid == proc.life]
        return steps[-1] if steps else 0

    def position(self, group: int) -> int:
        """The job's step `group`'s current process stands at, which its hold compares with: under
        diloco a heal jumps it to the peer's step (the ledger records the inner step trained), and a
        process that has trained nothing yet stands where it loaded its checkpoint (0 if none)."""
        committed = self.committed(group)  # the ledger: its row comes after the step's event (chaos_job.py)
        if self.config != "diloco":
            return committed
        pid = self.procs[group].life
        if not committed:
            return _loaded_step(self.out, group, pid)
        return _healed_steps(self.out, group).get((pid, committed), committed)

    # -- holds ----------------------------------------------------------------------------------
    def hold(self, group: int, step: int) -> None:
        part = self.out / f"hold-{group}.part"
        part.write_text(str(step))
        part.replace(self.out / f"hold-{group}")

    def release(self, group: int) -> None:
        (self.out / f"hold-{group}").unlink(missing_ok=True)

    def hold_both_at(self, step: int) -> int:
        """Both groups wait once they have recorded `step` (or at once, if already past it), or a
        later step that diloco's syncs let both reach (`_reachable`); returns the step held at."""
        step = self._reachable(step)
        for group in (0, 1):
            self.hold(group, step)
        for group in (0, 1):
            self._wait(lambda: self.position(group) >= step or self.procs[group].poll() is not None,
                       f"group {group} to reach step {step}", alive=False)
        return step

    def _reachable(self, step: int) -> int:
        """`step`, or under diloco the first step at or after it that both groups can reach while held.

        Groups that resumed from their own checkpoints on either side of a sync (a kill of both lands
        between an odd step's background save and the next) meet at the next sync of the one ahead:
        the one behind waits in its own sync's quorum until then and heals there. Held before that
        sync, the one ahead would never come, and the one behind would give up its quorum (its timeout)
        and train on alone: two logging groups. So such a hold moves to the sync of the one ahead.
        """
        if self.config != "diloco" or any(self.procs[g].poll() is not None for g in (0, 1)):
            return step
        behind, ahead = sorted((self.position(0), self.position(1)))
        next_sync = lambda at: (at // DILOCO_SYNC_EVERY + 1) * DILOCO_SYNC_EVERY  # noqa: E731
        if next_sync(behind) < next_sync(ahead) and next_sync(behind) <= step < next_sync(ahead):
            return next_sync(ahead)
        return step

    # -- faults -----------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> None:
        getattr(self, "_" + fault.kind.replace("-", "_"))(fault)

    def _kill(self, groups: tuple[int, ...], sig: int = signal.SIGKILL) -> None:
        for group in groups:
            if self.procs[group].poll() is None:
                os.kill(self.procs[group].pid, sig)
        for group in groups:
            self.procs[group].wait(timeout=PATIENCE)

    def _kill_group(self, fault: Fault) -> None:
        victim, survivor = fault.group, 1 - fault.group
        held = self.hold_both_at(fault.step)
        self._kill((victim,))
        self.release(victim)
        if self.procs[survivor].poll() is None:
            self.hold(survivor, self.position(survivor) + fault.alone)
        self._wait(lambda: self.procs[survivor].poll() is not None or self.position(survivor) >= held + fault.alone
                   or not (self.out / f"hold-{survivor}").exists(), f"group {survivor} to train alone", alive=False)
        asked = self._quorum_requests(victim)
        self.start((victim,))
        if self.config == "diloco":
            # The survivor stays held until the victim asks for its first quorum, at its next sync, where
            # it waits (the lighthouse forms no quorum of one group while another heartbeats), so the
            # survivor's next sync meets it. Released at once, the survivor could end its 24 steps first,
            # and the victim would then train alone to the end, logging those steps a second time.
            self._wait(lambda: self._quorum_requests(victim) > asked, f"group {victim} to ask for a quorum", victim)
        self.release(survivor)
        if self.config == "diloco":  # until the victim is past the survivor's steps alone (healed, if it must)
            back = held + fault.alone
            self._wait(lambda: self.procs[victim].poll() is not None or self.committed(victim) > back,
                       f"group {victim} to be back in step", alive=False)

    def _kill_job(self, fault: Fault) -> None:
        self.hold_both_at(fault.step)
        self._kill((0, 1))
        self.release(0), self.release(1)
        self.start()

    def _preempt_job(self, fault: Fault) -> None:
        self.hold_both_at(fault.step)
        self._signal_and_release(signal.SIGTERM)
        for group in (0, 1):
            assert self.procs[group].wait(timeout=PATIENCE) == 0, f"group {group} failed at SIGTERM:\n{self.log(group)}"
        self.start()

    def _signal_and_release(self, sig: int) -> None:
        for group in (0, 1):
            if self.procs[group].poll() is None:
                os.kill(self.procs[group].pid, sig)
        self.release(0), self.release(1)

    def _store_down(self, fault: Fault) -> None:
        self.hold_both_at(fault.step)
        self.server.stop()
        try:
            self.release(0), self.release(1)
            for group in (0, 1):  # each fails at a save (the second once it is the one that uploads)
                self.procs[group].wait(timeout=PATIENCE)
        finally:
            self.server.start()
        self.start()

    def _tracker_down(self, fault: Fault) -> None:
        held = self.hold_both_at(fault.step)
        self.mlflow.stop()
        try:
            held = self.hold_both_at(held + MLFLOW_DOWN_STEPS)  # each step's save finds no server
        finally:
            self.mlflow.start()
        self.hold_both_at(held + 1)  # that step's save sends what was kept
        self.release(0), self.release(1)

    def _slow_group(self, fault: Fault) -> None:
        self.hold_both_at(fault.step)
        (self.out / f"slow-{fault.group}").touch()  # for the rest of the run
        self.release(0), self.release(1)

    def finish(self) -> None:
        """Release every hold and wait until both groups finished the job."""
        self.release(0), self.release(1)
        for group in (0, 1):
            proc = self.procs[group]
            if proc.poll() is None:
                proc.wait(timeout=PATIENCE)
            if not (self.out / f"done-{group}").exists():  # it ended with its peer gone: start it again
                self.start((group,))
                assert self.procs[group].wait(timeout=PATIENCE) == 0, f"group {group} failed:\n{self.log(group)}"
            assert (self.out / f"done-{group}").exists(), f"group {group} did not finish:\n{self.log(group)}"

    def processes(self) -> list[int]:
        """Every live process of the job: the groups' and whatever they started, in a session of its
        own too (a W&B service), found by the job's environment (`job_env`'s `LITE_JOB_ID`)."""
        from conftest import processes_carrying  # the repository's conftest.py

        return processes_carrying(f"LITE_JOB_ID=chaos-{self.out.name}")

    def left_over(self) -> list[int]:
        """The job's processes still alive `PATIENCE` seconds after both groups finished (a hang
        guard: they end with their group within a second or two)."""
        from conftest import outliving  # the repository's conftest.py

        return outliving(self.processes, PATIENCE)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def job_env(out: Path, bucket: str, server: Any, mlflow: MLflowServer, config: str = "ddp_ft") -> dict[str, str]:
    """What the job's processes (and its plain run) need besides the launch variables: the stream,
    the S3 server's client settings, the trackers, the strategy."""
    return {"CHAOS_STREAM": stream_url(bucket), "TRACKIO_DIR": str(out / "trackio"), "LITE_JOB_ID": f"chaos-{out.name}",
            "CHAOS_MLFLOW_URI": mlflow.uri, "CHAOS_MLFLOW_EXPERIMENT": f"chaos-{out.name}", "WANDB_SILENT": "true",
            "CHAOS_STRATEGY": config, **server.env}


def ledger(out: Path, group: int) -> list[tuple[int, int, int, list[int]]]:
    """(epoch, step, pid, sample ids) of each step a process of `group` committed, in order."""
    lines = [line.split() for line in _text(out / f"ledger-{group}").splitlines()]
    return [(int(epoch), int(step), int(pid), [int(r) for r in rows]) for epoch, step, pid, *rows in lines]


def run(out: Path, lighthouse: str, bucket: str, server: Any, env: Callable[..., dict[str, str]],
        free_port: Callable[[], int], schedule: list[Fault], mlflow: MLflowServer, config: str = "ddp_ft") -> Report:
    """Run the job under `schedule` in configuration `config` (`CONFIGS`) and check it (raises
    `AssertionError` naming what failed). `bucket` is the checkpoints' folder on `server`; the
    stream goes beside it (`stream_url`)."""
    print(f"chaos schedule ({config}): " + "; ".join(map(str, schedule)), flush=True)
    started = time.monotonic()
    write_stream(stream_url(bucket))
    job = ChaosJob(out, lighthouse, bucket, server, env, free_port, mlflow, config)
    try:
        job.start()
        for fault in schedule:
            job.inject(fault)
        job.finish()
        left = job.left_over()  # before stop_all, which kills whatever is left
    finally:
        job.stop_all()
    from conftest import describe_processes  # the repository's conftest.py

    assert not left, f"processes of the job still run after both groups finished: {describe_processes(left)}"
    report = Report(schedule, config, seconds=time.monotonic() - started)
    check(out, bucket, report, env(**job_env(out, bucket, server, mlflow, config)), mlflow.uri)
    heals = f", {report.heals} heals at a sync" if config == "diloco" else ""
    print(f"chaos report ({config}): {report.seconds:.0f} s, {report.steps_trained_again} steps trained again,"
          f" {report.samples_repeated} samples repeated, {report.samples_skipped} skipped by a heal, {report.wandb_steps_twice} steps twice in W&B's files{heals}",
          flush=True)
    return report


def check(out: Path, bucket: str, report: Report, env: dict[str, str], mlflow_uri: str) -> None:
    """The promises a cloud user's job keeps under faults (see the module's docstring; no process
    left is checked before it, `ChaosJob.left_over`); `env` is the job's environment (for its plain run)."""
    _check_every_sample_once(out, report)
    for group in (0, 1):  # the core's warning that a loader resumed at its epoch's start (the strategy resumes it)
        log = (out / f"group-{group}.log").read_text()
        assert "starts again from its first sample" not in log, f"group {group} lost its loader's position:\n{log}"
    trained = _trained(out)
    _check_tracker(out, trained)
    _check_mlflow(out, mlflow_uri, trained)
    _check_wandb(out, trained, report)
    if report.config == "diloco":
        _check_diloco_weights(out, env, report)
        for group in (0, 1):
            _check_bucket(f"{bucket}/group-{group}")
    else:
        _check_weights(out, env)
        _check_bucket(bucket)


def _check_every_sample_once(out: Path, report: Report) -> None:
    from conftest import check_each_sample_once  # the repository's conftest.py (test_chaos and the soak put it on the path)

    records = [(epoch, step, rows) for group in (0, 1) for epoch, step, _, rows in ledger(out, group)]
    skipped = frozenset(step for group in (0, 1) for step in _skipped_steps(out, group))
    # raises where a sample repeats, or is missing from a step no heal jumped over
    report.samples_skipped = check_each_sample_once(records, STEPS, BATCH, STEPS_PER_EPOCH, SAMPLES, skipped)
    steps_recorded = {(group, step) for group in (0, 1) for _, step, _, _ in ledger(out, group)}
    report.steps_trained_again = sum(
        len([1 for _, step, _, _ in ledger(out, group)]) for group in (0, 1)) - len(steps_recorded)


def _trained(out: Path) -> dict[int, set[float]]:
    """Per step, the values a tracker may hold for it: the sum of each group's share of the batch.
    Under diloco a group that healed at a sync logs that inner step as the job's step it jumped to
    (its peer's, `OUT/diloco-<group>`: outer step x sync_every), as a user's loop counting steps would."""
    trained: dict[int, set[float]] = defaultdict(set)
    for group in (0, 1):
        jumped = _healed_steps(out, group)
        for _, step, pid, rows in ledger(out, group):
            trained[jumped.get((pid, step), step)].add(float(sum(rows)))
    return trained


def _healed_steps(out: Path, group: int) -> dict[tuple[int, int], int]:
    """diloco: (pid, inner step) -> the job's step, for each step at whose sync `group` healed."""
    return {(pid, step): outer * DILOCO_SYNC_EVERY for step, pid, _, healed, outer in _diloco_steps(out, group)
            if healed}


def _skipped_steps(out: Path, group: int) -> list[int]:
    """diloco: the job's steps `group` jumped over by healing (a heal at its inner step i to the job's
    step j skips its share of steps i+1..j). Its peer trained them on whole batches if it had synced
    alone since; if not, the group's share of them is trained by no group: a group that resumed from a
    checkpoint older than a sync it had taken part in (its save of the sync step failed or was cut off)
    meets its peer only at the peer's next sync (see docs/regions.md)."""
    return [skipped for (_, step), jumped in _healed_steps(out, group).items() for skipped in range(step + 1, jumped + 1)]


def _loaded_step(out: Path, group: int, pid: int) -> int:
    """The step process `pid` of `group` loaded its checkpoint at (chaos_job.py's `load` event; 0 if it
    started fresh)."""
    loads = [step for step, at in _diloco_events(out, group, "load") if at == pid]
    return loads[-1] if loads else 0


def _diloco_steps(out: Path, group: int) -> list[tuple[int, ...]]:
    """`group`'s diloco step events: (inner step, pid, participants, healed, outer step) each; none
    outside diloco."""
    return _diloco_events(out, group, "step")


def _diloco_events(out: Path, group: int, kind: str) -> list[tuple[int, ...]]:
    """The numbers of each `kind` event (`step`, `load`) that chaos_job.py wrote to `OUT/diloco-<group>`,
    in order (none outside diloco)."""
    lines = _text(out / f"diloco-{group}").splitlines()
    return [tuple(map(int, line.split()[1:])) for line in lines if line.startswith(f"{kind} ")]


def _text(path: Path) -> str:
    """The text of `path` ("" if it does not exist), read again only when its size or time changed:
    the harness's waits ask for the ledger and the event files every 20 ms."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return ""
    return _text_as_of(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _text_as_of(path: Path, size: int, mtime_ns: int) -> str:
    return path.read_text()


def _check_tracker(out: Path, trained: dict[int, set[float]]) -> None:
    """One trackio run holding every step once, each with a value the ledger says the step trained
    on (the sum of the logging group's share of the batch): a step logged after the last checkpoint of a killed job, or
    by a group that died, is neither lost nor logged twice."""
    check_trackio_run(out / "trackio", "chaos", "batch", trained, STEPS, PATIENCE)


def _check_mlflow(out: Path, uri: str, trained: dict[int, set[float]]) -> None:
    """One MLflow run on the server holding every step once, each with a value the ledger says;
    nothing left unsent (conftest's `check_mlflow_run`)."""
    check_mlflow_run(uri, f"chaos-{out.name}", "batch", trained, STEPS, [out])


def _check_wandb(out: Path, trained: dict[int, set[float]], report: Report) -> None:
    """One W&B run id over the job's offline folders, every step once as `wandb sync` keeps it, a
    step with two values only where the ledger shows it trained twice with them (conftest's
    `check_wandb_run`); those steps are counted in `report.wandb_steps_twice`."""
    report.wandb_steps_twice = check_wandb_run(sorted((out / "wandb" / "wandb").glob("offline-run-*")), "batch",
                                               trained, STEPS)


def _check_weights(out: Path, env: dict[str, str]) -> None:
    first, second = (torch.load(out / f"weights-{g}.pt", weights_only=True) for g in (0, 1))
    assert all(torch.equal(first[name], second[name]) for name in first), "the groups ended with other weights"
    subprocess.run([sys.executable, str(SCRIPT), str(out), "plain"], check=True, timeout=PATIENCE, env=env)
    plain = torch.load(out / "weights-plain.pt", weights_only=True)
    for name in plain:
        torch.testing.assert_close(first[name], plain[name], rtol=0, atol=1e-5)


#: diloco: how far the groups' weights may be from the simulation of what happened (float32; seen: 0.0).
DILOCO_TOLERANCE = 1e-6


def _check_diloco_weights(out: Path, env: dict[str, str], report: Report) -> None:
    """Both groups end equal (the last step, 24, is a sync of both) and where `chaos_job.replay`,
    the one-process simulation of the syncs, heals and rollbacks the groups recorded, ends; after a
    heal, far from where the same job without faults ends (`replay forget-faults`)."""
    first, second = (torch.load(out / f"weights-{g}.pt", weights_only=True) for g in (0, 1))
    assert all(torch.equal(first[name], second[name]) for name in first), "the groups ended with other weights"
    report.heals = sum(len(_healed_steps(out, g)) for g in (0, 1))
    subprocess.run([sys.executable, str(SCRIPT), str(out), "replay"], check=True, timeout=PATIENCE, env=env)
    simulated = torch.load(out / "weights-replay.pt", weights_only=True)
    for name in simulated:
        torch.testing.assert_close(first[name], simulated[name], rtol=0, atol=DILOCO_TOLERANCE)
    if report.heals:  # the comparison sees what a heal changed: the same job without faults ends elsewhere
        subprocess.run([sys.executable, str(SCRIPT), str(out), "replay", "forget-faults"], check=True,
                       timeout=PATIENCE, env=env)
        straight = torch.load(out / "weights-replay.pt", weights_only=True)
        distance = max(float((first[name] - straight[name]).abs().max()) for name in first)
        assert distance > 1e-3, f"the run ends {distance:.2g} from a run without faults: the heal changed nothing?"


def _check_bucket(bucket: str) -> None:
    import fsspec

    from lite_core import LightningLite
    from lite_core.checkpoint import latest

    last = latest(bucket)
    assert last is not None and last.endswith(f"/step-{STEPS}"), f"the last checkpoint is {last}"
    content = LightningLite(accelerator="cpu").load(last)  # weights_only: plain tensors and values
    assert content["step"] == STEPS and content["epoch"] == STEPS // STEPS_PER_EPOCH
    fs, _, [root] = fsspec.get_fs_token_paths(bucket)
    fs.invalidate_cache()
    names = [path.rsplit("/", 1)[-1] for path in fs.find(root)]
    leftovers = [name for name in names if name.startswith(".")]
    assert not leftovers, f"temporary uploads left in the bucket: {leftovers}"

