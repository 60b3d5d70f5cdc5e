"""The chaos job: docs/preemption.md's loop as a cloud user runs it under `ddp_ft` (one replica
group of one process; the harness, tests/_chaos.py, starts two and injects the faults), or under
`diloco` with `CHAOS_STRATEGY=diloco` (`DiLoCoStrategy(sync_every=4)`, DiLoCo's outer Nesterov SGD
at 0.7 and 0.9).

    python chaos_job.py OUT BUCKET        # one group (REPLICA_GROUP_ID etc. in the environment)
    python chaos_job.py OUT plain         # the same loop in plain PyTorch: OUT/weights-plain.pt
    python chaos_job.py OUT replay        # diloco: what happened, simulated: OUT/weights-replay.pt

The data is a Hugging Face `datasets` stream read from the bucket's server (`CHAOS_STREAM`: the
URL of a folder of JSON-lines files that the harness wrote, `write_stream`), through a shuffle
buffer seeded by the epoch. Two epochs of it (`split_batches=True`: each loader batch is the
step's global batch, which the groups alive in the step split), the set-up loader in the saved
state, resumed at the top from `latest(BUCKET)`, saved to `BUCKET/step-N` after every committed
step (every other one in the background), stopped on SIGTERM with a last foreground save. The job
keeps its own ledger: right after each committed step, before saving, a line `epoch step pid
rows...` (the sample ids this process trained on) goes to `OUT/ledger-<group>`, flushed and
synced. It also logs the sum of its step's sample ids as `batch` at the committed step to three
trackers, each part of the saved state as docs/logging.md shows and each holding one run for the
job through LITE_JOB_ID: a `TrackioLogger` (project `chaos`, its store in TRACKIO_DIR), an
`MLflowLogger` (the server at `CHAOS_MLFLOW_URI`, experiment `CHAOS_MLFLOW_EXPERIMENT`) and a
`WandbLogger` offline (its files under `OUT/wandb`). Between steps the group waits while
`OUT/hold-<group>` names a step it has reached (the harness lands its faults there), and at the
start while `OUT/gate` exists; while `OUT/slow-<group>` exists it sleeps 10 times longer between
steps (a slow rank). A finished group writes `OUT/weights-<group>.pt` and `OUT/done-<group>`; a
preempted one returns after its last save without them.

Under `diloco` each group holds its own weights between syncs, so each saves under its own folder,
`BUCKET/group-<group>/step-N` (docs/backends/torchft.md, Checkpoints), and resumes from its own
latest. The job's step is the inner step (the global batch's number in the job); a group that heals
from a peer at a sync jumps to the peer's step. Besides the ledger, each group writes
`OUT/diloco-<group>`: `load STEP PID` after it loaded a checkpoint, and after each inner step
`step STEP PID PARTICIPANTS HEALED OUTER` (the groups in the step's sync, 0 if it did not sync;
whether this group took a peer's state there; the outer steps after it). `replay` reads these and
the ledger and computes in one process what the groups computed (`replay`). `CHAOS_PLANT=no-outer-heal`
plants a fault: a group that heals keeps its own outer optimizer state; `CHAOS_PLANT=orphan` has each
group's process start one in a session of its own that outlives the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ft_train import _held, life  # the same hold between steps as the heal tests' script

EPOCHS = 2
BATCH = 4  # the global batch
SAMPLES = 48  # 12 steps an epoch
SLEEP = float(os.environ.get("CHAOS_STEP_SLEEP", "0.05"))
STRATEGY = os.environ.get("CHAOS_STRATEGY", "ddp_ft")  # or "diloco"
SYNC_EVERY = 4  # diloco: inner steps between outer syncs (6 syncs in the job's 24 steps)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # diloco: DiLoCoStrategy's defaults, the DiLoCo paper's


def stream() -> Any:
    """The Hugging Face stream of `CHAOS_STREAM`'s files, shuffled through a buffer of 8 rows whose
    seed is 0 plus the epoch (`set_epoch`), as torch tensors."""
    import datasets

    datasets.disable_progress_bars()
    files = datasets.load_dataset("json", data_files=f"{os.environ['CHAOS_STREAM']}/part-*.jsonl", split="train",
                                  streaming=True)
    return files.shuffle(seed=0, buffer_size=8).with_format("torch")


def unpack(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stream batch as (x, y, sample ids)."""
    return batch["x"].float(), batch["y"].float().unsqueeze(1), batch["id"]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def plain(out: Path) -> None:
    """One plain PyTorch process reading the same stream: where a job without faults ends."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = stream()
    loader = DataLoader(data, batch_size=BATCH)
    for epoch in range(EPOCHS):
        data.set_epoch(epoch)
        for batch in loader:
            x, y, _ = unpack(batch)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    torch.save(net.state_dict(), out / "weights-plain.pt")


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample's (x, y) by id, as `_chaos.write_stream` wrote them (exact through JSON)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 3, generator=generator)
    return x, (x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1).unsqueeze(1)


def _events(out: Path, group: int) -> list[list[int | str]]:
    path = out / f"diloco-{group}"
    lines = path.read_text().splitlines() if path.exists() else []
    return [[line.split()[0], *map(int, line.split()[1:])] for line in lines]


def replay(out: Path, forget_faults: bool = False) -> None:
    """DiLoCo as the groups ran it, in one process, from their ledgers and `OUT/diloco-<group>`:
    each group's inner SGD on the very samples its ledger says it trained (whole batches, halves,
    steps trained again after loading a checkpoint, steps whose work a heal threw away), its outer
    Nesterov SGD at each sync over the groups in that sync (their pseudo-gradients averaged: the
    weights of the last sync minus the group's), a group that loads a checkpoint taking its own
    state after that step, and a group that heals taking its peer's whole state (inner and outer
    optimizers, weights of the last sync) after the peer's sync. Writes group 0's final weights to
    OUT/weights-replay.pt. `forget_faults`: a run without faults (each group its half of every
    batch) instead, which a job with a fault must not match."""
    import copy

    from torch.nn.functional import mse_loss

    x, y = samples()
    nets = [model() for _ in (0, 1)]
    inner = [torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9) for net in nets]
    origins = [model() for _ in (0, 1)]  # each group's weights of its last sync
    outer = [torch.optim.SGD(o.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for o in origins]
    saved: list[dict[int, Any]] = [{}, {}]  # a group's state after each step it recorded (its checkpoints)

    def state(g: int) -> Any:
        return copy.deepcopy([nets[g].state_dict(), inner[g].state_dict(), origins[g].state_dict(),
                              outer[g].state_dict()])

    def take(g: int, content: Any) -> None:
        content = copy.deepcopy(content)
        for target, value in zip((nets[g], inner[g], origins[g], outer[g]), content):
            target.load_state_dict(value)

    def train(g: int, rows: list[int]) -> None:
        inner[g].zero_grad()
        mse_loss(nets[g](x[rows]), y[rows]).backward()
        inner[g].step()

    def sync(groups: list[int]) -> None:
        with torch.no_grad():
            pseudo = [[o - p for o, p in zip(origins[g].parameters(), nets[g].parameters())] for g in groups]
            average = [sum(grads) / len(groups) for grads in zip(*pseudo)]
        for g in groups:
            for parameter, grad in zip(origins[g].parameters(), average):
                parameter.grad = grad.clone()
            outer[g].step()
            outer[g].zero_grad()
            with torch.no_grad():
                for parameter, result in zip(nets[g].parameters(), origins[g].parameters()):
                    parameter.copy_(result)

    if forget_faults:
        halves: dict[int, list[list[int]]] = {}  # each step's global batch in the loader's order
        for group in (0, 1):
            for line in (out / f"ledger-{group}").read_text().splitlines():
                _, step, _, *rows = map(int, line.split())
                halves.setdefault(step, [[], []])[group if len(rows) < BATCH else 0] = rows
        for step in range(1, len(halves) + 1):
            ids = halves[step][0] + (halves[step][1] if len(halves[step][0]) < BATCH else [])
            half = len(ids) // 2
            for g, share in ((0, ids[:half]), (1, ids[half:])):
                train(g, share)
            if step % SYNC_EVERY == 0:
                sync([0, 1])
        torch.save(nets[0].state_dict(), out / "weights-replay.pt")
        return

    # each group's events in order: ("load", step) or ("step", step, rows, participants, healed, outer)
    timelines: list[list[tuple[Any, ...]]] = []
    for group in (0, 1):
        rows_of = [line.split() for line in (out / f"ledger-{group}").read_text().splitlines()]
        ledger_rows = iter([(int(step), int(pid), [int(r) for r in rows]) for _, step, pid, *rows in rows_of])
        events = []
        for event in _events(out, group):
            if event[0] == "load":
                events.append(("load", event[1]))
            else:
                _, step, pid, participants, healed, outer_steps = event
                ledger_step, ledger_pid, rows = next(ledger_rows)
                assert (ledger_step, ledger_pid) == (step, pid), f"group {group}: ledger and events disagree at {step}"
                events.append(("step", step, rows, participants, healed, outer_steps))
        timelines.append(events)
    at = [0, 0]

    def advance(g: int) -> tuple[Any, ...] | None:
        """Run group g's events up to its next sync with its peer (returned, not run), or to its end."""
        while at[g] < len(timelines[g]):
            event = timelines[g][at[g]]
            if event[0] == "load":
                take(g, saved[g][event[1]])
            else:
                _, step, rows, participants, healed, _ = event
                if participants == 2:
                    return event
                train(g, rows)
                if participants == 1:
                    sync([g])
                saved[g][step] = state(g)
            at[g] += 1
        return None

    while True:
        pending = [advance(0), advance(1)]
        if pending == [None, None]:
            break
        assert None not in pending, f"a sync of both groups that one group did not record: {pending}"
        (_, step0, rows0, _, healed0, outer0), (_, step1, rows1, _, healed1, outer1) = pending
        assert outer0 == outer1, f"the groups' syncs do not match: {pending}"
        train(0, rows0), train(1, rows1)
        if healed0 or healed1:  # the healed one took its peer's state at the sync: the peer's sync alone
            peer = 1 if healed0 else 0
            sync([peer])
            take(1 - peer, state(peer))
        else:
            sync([0, 1])
        # each group's checkpoint of that sync is at the job's step (a healed group's is its peer's)
        saved[0][outer0 * SYNC_EVERY], saved[1][outer1 * SYNC_EVERY] = state(0), state(1)
        at[0] += 1
        at[1] += 1
    torch.save(nets[0].state_dict(), out / "weights-replay.pt")


def _record(out: Path, group: str, epoch: int, step: int, index: torch.Tensor) -> None:
    rows = " ".join(str(int(i)) for i in index.flatten().tolist())
    with open(out / f"ledger-{group}", "a") as ledger:
        ledger.write(f"{epoch} {step} {life()} {rows}\n")
        ledger.flush()
        os.fsync(ledger.fileno())


def lite(out: Path, bucket: str) -> None:
    from lite_core import LightningLite, MLflowLogger, TrackioLogger, WandbLogger
    from lite_core.checkpoint import latest
    from lite_torchft import DDPFTStrategy
    from lite_torchft.diloco import DiLoCoStrategy

    group = os.environ["REPLICA_GROUP_ID"]
    diloco = STRATEGY == "diloco"
    root = f"{bucket}/group-{group}" if diloco else bucket  # under diloco each group saves its own state

    def event(line: str) -> None:
        with open(out / f"diloco-{group}", "a") as events:
            events.write(line + "\n")
            events.flush()
            os.fsync(events.fileno())

    class Train(LightningLite):
        def run(self) -> None:
            stop = {"requested": False}
            signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))  # the scheduler's warning
            net = model()
            net, optimizer = self.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
            loader = self.setup_dataloaders(DataLoader(stream(), batch_size=BATCH), split_batches=True)
            state = {"model": net, "optimizer": optimizer, "loader": loader, "tracker": tracker, "mlflow": mlflow,
                     "wandb": wandb, "epoch": 0, "step": 0}
            if diloco and os.environ.get("CHAOS_PLANT") == "no-outer-heal":
                from diloco_train import _heal_without_the_outer_optimizer

                _heal_without_the_outer_optimizer(self.strategy.manager)
            if os.environ.get("CHAOS_PLANT") == "orphan":  # a process in a session of its own that outlives the job
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
            resumed = latest(root)
            if resumed is not None:
                self.load(resumed, state)
                if diloco:
                    event(f"load {state['step']} {life()}")
            (out / f"ready-{group}-{life()}").touch()
            while (out / "gate").exists():
                time.sleep(0.02)
            for epoch in range(state["epoch"], EPOCHS):
                for batch in loader:
                    x, y, index = unpack(batch)
                    optimizer.zero_grad()
                    self.backward(torch.nn.functional.mse_loss(net(x), y))
                    before = self.strategy.step
                    if diloco:  # every inner step commits; at a sync the group may heal and jump
                        heals = self.strategy.fault_tolerance_figures()["fault/heals"]
                        optimizer.step()
                        trained = state["step"] + 1
                        healed = self.strategy.fault_tolerance_figures()["fault/heals"] > heals
                        synced = healed or self.strategy.step != before
                        participants = int(self.strategy.manager.num_participants()) if synced else 0
                        state["step"] = self.strategy.step * SYNC_EVERY if healed else trained
                        assert healed or not synced or state["step"] == self.strategy.step * SYNC_EVERY, (
                            f"inner step {trained} synced as outer step {self.strategy.step}")
                        state["epoch"] = epoch
                        # the event first: the harness kills once the ledger shows the step (a soak run
                        # killed a group between the two writes, and the simulation found no event for it)
                        event(f"step {trained} {life()} {participants} {int(healed)} {self.strategy.step}")
                        _record(out, group, epoch, trained, index)
                        # from the group that logs, at the job's step: the peer's, after a heal
                        self.log("batch", float(index.sum()), step=state["step"])
                    else:
                        optimizer.step()
                        if self.strategy.step == before:
                            continue  # the step did not commit: its batch comes again
                        state["step"], state["epoch"] = self.strategy.step, epoch
                        _record(out, group, epoch, state["step"], index)
                        self.log("batch", float(index.sum()), step=state["step"])  # from the group that logs
                    if self.all_reduce(torch.tensor(float(stop["requested"])), reduce_op="max") > 0:
                        self.save(state, f"{root}/step-{state['step']}")
                        return
                    self.save(state, f"{root}/step-{state['step']}", blocking=state["step"] % 2 == 0)
                    time.sleep(SLEEP * (10 if (out / f"slow-{group}").exists() else 1))
                    while _held(out, group, state["step"]):
                        time.sleep(0.02)
                state["epoch"] = epoch + 1
            weights = {name: tensor.detach().clone() for name, tensor in net.state_dict().items()}
            self.save(state, f"{root}/step-{state['step']}")  # waits for the last background save too
            torch.save(weights, out / f"weights-{group}.pt")
            (out / f"done-{group}").touch()

    import trackio.run

    # trackio's client writes its rows every half second; W&B offline's every 15 s. At an hour only the
    # logger's write at `save` makes a logged step durable before a kill, which is what this job checks.
    trackio.run.BATCH_SEND_INTERVAL = 3600.0
    tracker = TrackioLogger(project="chaos")
    mlflow = MLflowLogger(experiment_name=os.environ["CHAOS_MLFLOW_EXPERIMENT"],
                          tracking_uri=os.environ["CHAOS_MLFLOW_URI"], fallback_dir=out, request_timeout=5)
    wandb = WandbLogger(project="chaos", save_dir=out / "wandb", mode="offline")
    strategy = (DiLoCoStrategy(sync_every=SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, ft_timeout=5)
                if diloco else DDPFTStrategy(ft_timeout=5))
    Train(accelerator="cpu", strategy=strategy, loggers=[tracker, mlflow, wandb]).run()


if __name__ == "__main__":
    if sys.argv[2] == "plain":
        plain(Path(sys.argv[1]))
    elif sys.argv[2] == "replay":
        replay(Path(sys.argv[1]), forget_faults="forget-faults" in sys.argv[3:])
    else:
        lite(Path(sys.argv[1]), sys.argv[2])
