"""The chaos harness: two replica groups of scripts/chaos_job.py under a seeded schedule of faults,
and the checks a cloud user's job must pass afterwards. Used by test_chaos.py (three seeds in CI)
and by benchmarks/chaos_soak.py (a longer soak: `--faults N --seed S`).

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
- `slow-group`: one group sleeps 10 times longer between steps for the rest of the run.

Afterwards (`check`): every epoch trained each sample exactly once (the job's ledger: steps that
were trained again after a rollback to the last checkpoint count once, and must have taken the
same batch), the tracker holds one run with every step once and the value the ledger says
(`_check_tracker`), the groups' weights are equal and equal to one plain process's to 1e-5, the last
checkpoint is the last step's and loads with `weights_only`, no temporary upload is left in the
bucket, and no process of the job is left running.
"""

from __future__ import annotations

import dataclasses
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

SCRIPT = Path(__file__).parent / "scripts" / "chaos_job.py"
STEPS = 24  # chaos_job: 2 epochs of 12 global batches
STEPS_PER_EPOCH = 12
SAMPLES = 48
BATCH = 4
KINDS = ("kill-group", "kill-job", "preempt-job", "store-down", "slow-group")
#: Seconds a group may take for anything the harness waits on: a hang guard, far above the idle time.
PATIENCE = 120.0


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
    """A schedule of `faults` faults at distinct steps, in step order."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, STEPS - 4), faults))
    schedule = []
    for step in steps:
        kind = rng.choice(KINDS)
        schedule.append(Fault(kind, step, group=rng.randrange(2), alone=rng.randrange(1, 4)))
    return schedule


@dataclasses.dataclass
class Report:
    """What a run saw: the schedule, the steps trained again, the samples trained more than once
    per epoch (0 when it passes), and the seconds the run took."""

    schedule: list[Fault]
    steps_trained_again: int = 0
    samples_repeated: int = 0
    seconds: float = 0.0


class ChaosJob:
    """The two groups of one run, in folder `out`, meeting at `lighthouse`, saving under `bucket`."""

    def __init__(self, out: Path, lighthouse: str, bucket: str, server: Any, env: Callable[..., dict[str, str]],
                 free_port: Callable[[], int]) -> None:
        self.out, self.lighthouse, self.bucket, self.server = out, lighthouse, bucket, server
        self._env, self._free_port = env, free_port
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.pids: set[int] = set()

    # -- processes --------------------------------------------------------------------------------
    def start(self, groups: tuple[int, ...] = (0, 1)) -> None:
        """Start `groups` behind the gate and open it once each is ready (so they meet together)."""
        (self.out / "gate").touch()
        for group in groups:
            env = self._env(LITE_COLLECTIVE_TIMEOUT="20", REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2",
                            TRACKIO_DIR=str(self.out / "trackio"), LITE_JOB_ID=f"chaos-{self.out.name}",
                            TORCHFT_LIGHTHOUSE=self.lighthouse, MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(self._free_port()),
                            **self.server.env)
            log = (self.out / f"group-{group}.log").open("a")
            self.procs[group] = subprocess.Popen([sys.executable, str(SCRIPT), str(self.out), self.bucket], env=env,
                                                 text=True, stdout=log, stderr=subprocess.STDOUT)
            self.pids.add(self.procs[group].pid)
        for group in groups:
            proc = self.procs[group]
            self._wait(lambda: any(self.out.glob(f"ready-{group}-{proc.pid}")), f"group {group} to be ready", group)
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

    def committed(self, group: int) -> int:
        """The last step `group`'s current process recorded (0 before its first)."""
        proc = self.procs[group]
        steps = [step for _, step, pid, _ in ledger(self.out, group) if pid == proc.pid]
        return steps[-1] if steps else 0

    # -- holds ----------------------------------------------------------------------------------
    def hold(self, group: int, step: int) -> None:
        part = self.out / f"hold-{group}.part"
        part.write_text(str(step))
        part.replace(self.out / f"hold-{group}")

    def release(self, group: int) -> None:
        (self.out / f"hold-{group}").unlink(missing_ok=True)

    def hold_both_at(self, step: int) -> None:
        """Both groups wait once they have recorded `step` (or at once, if already past it)."""
        for group in (0, 1):
            self.hold(group, step)
        for group in (0, 1):
            self._wait(lambda: self.committed(group) >= step or self.procs[group].poll() is not None,
                       f"group {group} to reach step {step}", alive=False)

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
        self.hold_both_at(fault.step)
        self._kill((victim,))
        self.release(victim)
        if self.procs[survivor].poll() is None:
            self.hold(survivor, self.committed(survivor) + fault.alone)
        self._wait(lambda: self.procs[survivor].poll() is not None or self.committed(survivor) >= fault.step + fault.alone
                   or not (self.out / f"hold-{survivor}").exists(), f"group {survivor} to train alone", alive=False)
        self.start((victim,))
        self.release(survivor)

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

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def ledger(out: Path, group: int) -> list[tuple[int, int, int, list[int]]]:
    """(epoch, step, pid, sample ids) of each step a process of `group` committed, in order."""
    path = out / f"ledger-{group}"
    if not path.exists():
        return []
    lines = [line.split() for line in path.read_text().splitlines()]
    return [(int(epoch), int(step), int(pid), [int(r) for r in rows]) for epoch, step, pid, *rows in lines]


def run(out: Path, lighthouse: str, bucket: str, server: Any, env: Callable[..., dict[str, str]],
        free_port: Callable[[], int], schedule: list[Fault]) -> Report:
    """Run the job under `schedule` and check it (raises `AssertionError` naming what failed)."""
    print("chaos schedule: " + "; ".join(map(str, schedule)), flush=True)
    started = time.monotonic()
    job = ChaosJob(out, lighthouse, bucket, server, env, free_port)
    try:
        job.start()
        for fault in schedule:
            job.inject(fault)
        job.finish()
    finally:
        job.stop_all()
    report = Report(schedule, seconds=time.monotonic() - started)
    check(out, bucket, job.pids, report)
    return report


def check(out: Path, bucket: str, pids: set[int], report: Report) -> None:
    """The promises a cloud user's job keeps under faults (see the module's docstring)."""
    _check_every_sample_once(out, report)
    _check_tracker(out)
    _check_weights(out)
    _check_bucket(bucket)
    alive = [pid for pid in pids if _running(pid)]
    assert not alive, f"processes of the job still run: {alive}"


def _check_every_sample_once(out: Path, report: Report) -> None:
    by_step: dict[int, set[int]] = defaultdict(set)
    epochs: dict[int, int] = {}
    records = [record for group in (0, 1) for record in ledger(out, group)]
    for epoch, step, _, rows in records:
        by_step[step].update(rows)
        assert epochs.setdefault(step, epoch) == epoch, f"step {step} was recorded in epochs {epochs[step]} and {epoch}"
    assert sorted(by_step) == list(range(1, STEPS + 1)), f"steps missing from the ledger: {sorted(set(range(1, STEPS + 1)) - set(by_step))}"
    for step, rows in by_step.items():
        assert len(rows) == BATCH, f"step {step} trained on {sorted(rows)}: a step took two different batches"
    for epoch in range(STEPS // STEPS_PER_EPOCH):
        seen = [row for step, rows in by_step.items() if epochs[step] == epoch for row in rows]
        repeated = len(seen) - len(set(seen))
        report.samples_repeated += repeated
        assert repeated == 0 and sorted(seen) == list(range(SAMPLES)), (
            f"epoch {epoch} trained {len(set(seen))} distinct samples of {SAMPLES}, {repeated} more than once")
    steps_recorded = {(group, step) for group in (0, 1) for _, step, _, _ in ledger(out, group)}
    report.steps_trained_again = sum(
        len([1 for _, step, _, _ in ledger(out, group)]) for group in (0, 1)) - len(steps_recorded)


def _check_tracker(out: Path) -> None:
    """One tracker run holding every step once, each with a value the ledger says the step trained
    on (the sum of the logging group's share of the batch): a step logged after the last checkpoint of a killed job, or
    by a group that died, is neither lost nor logged twice."""
    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; runs = S.get_runs('chaos');"
            " print(json.dumps([runs, [S.get_logs('chaos', run) for run in runs]], default=str))")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRACKIO_DIR=str(out / "trackio")),
                          capture_output=True, text=True, timeout=PATIENCE, check=True)
    runs, logs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runs) == 1, f"the job logged to {len(runs)} tracker runs: {runs}"
    logged = [(int(row["step"]), row["batch"]) for row in logs[0] if "batch" in row]
    steps = [step for step, _ in logged]
    assert sorted(steps) == list(range(1, STEPS + 1)), (
        f"the tracker holds steps {steps}: missing {sorted(set(range(1, STEPS + 1)) - set(steps))},"
        f" twice {sorted({s for s in steps if steps.count(s) > 1})}")
    trained: dict[int, set[float]] = defaultdict(set)  # per step, the sum of each group's share of the batch
    for group in (0, 1):
        for _, step, _, rows in ledger(out, group):
            trained[step].add(float(sum(rows)))
    wrong = {step: (value, sorted(trained[step])) for step, value in logged if value not in trained[step]}
    assert not wrong, f"steps logged with a value no group trained (logged, trained): {wrong}"


def _check_weights(out: Path) -> None:
    first, second = (torch.load(out / f"weights-{g}.pt", weights_only=True) for g in (0, 1))
    assert all(torch.equal(first[name], second[name]) for name in first), "the groups ended with other weights"
    subprocess.run([sys.executable, str(SCRIPT), str(out), "plain"], check=True, timeout=PATIENCE)
    plain = torch.load(out / "weights-plain.pt", weights_only=True)
    for name in plain:
        torch.testing.assert_close(first[name], plain[name], rtol=0, atol=1e-5)


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


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
