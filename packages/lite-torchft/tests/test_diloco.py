"""`strategy="diloco"`: two replica groups on loopback compute the DiLoCo algorithm exactly.

The test starts the lighthouse (in this process) and both groups (tests/scripts/diloco_train.py,
one process each, `split_batches=True`, no failure). Their weights must equal one plain process
that simulates the algorithm (`diloco_train.simulate`), and with H=1, an outer SGD at lr 1 without
momentum, one plain data-parallel process (`ft_train.plain`). The simulation with the outer
momentum dropped, or the pseudo-gradient's sign flipped, must not match: the comparison sees them.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import free_port, killing_leftovers, script_env, start_life  # the repository's conftest.py
from lite_core import LightningLite
from lite_core.plugins import ConfigurationError
from lite_torchft.diloco import DiLoCoFSDPStrategy, DiLoCoStrategy, LocalSGDStrategy

SCRIPTS = Path(__file__).parent / "scripts"


def _load(name: str) -> Any:
    sys.path.insert(0, str(SCRIPTS))  # diloco_train imports ft_train, as it does when run as a script
    try:
        spec = importlib.util.spec_from_file_location(f"_{name}", SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def _run_groups(lighthouse: str, out: Path, *args: str) -> list[dict[str, torch.Tensor]]:
    """Both groups' final weights, after each ran `diloco_train.py OUT args` (started together:
    each waits at `OUT/gate` until both are set up)."""
    (out / "gate").touch()
    procs = [_start(group, lighthouse, out, args) for group in (0, 1)]
    with killing_leftovers(procs):
        _wait_until_ready(out, procs)
        (out / "gate").unlink()
        _wait_for_the_end(procs, out)
    return [torch.load(out / f"weights-{group}.pt", weights_only=True) for group in (0, 1)]


def _start(group: int, lighthouse: str, out: Path, args: tuple[str, ...], **env: str) -> subprocess.Popen[str]:
    """Group `group` running `diloco_train.py OUT args`, its output appended to OUT/group-<group>.log."""
    env = script_env(REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2", TORCHFT_LIGHTHOUSE=lighthouse,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **env)
    log = (out / f"group-{group}.log").open("a")
    return start_life([sys.executable, str(SCRIPTS / "diloco_train.py"), str(out), *args], env, stdout=log,
                      stderr=subprocess.STDOUT)


def _wait_until_ready(out: Path, procs: dict[int, subprocess.Popen[str]] | list[subprocess.Popen[str]]) -> None:
    """Until each group (index: process) is set up and waits at the gate."""
    procs = dict(enumerate(procs)) if isinstance(procs, list) else procs
    _wait(lambda: all(any(out.glob(f"ready-{group}-{proc.life}")) for group, proc in procs.items()),
          list(procs.values()), out, "set up")


def _wait(condition: Callable[[], bool], procs: list[subprocess.Popen[str]], out: Path, what: str) -> None:
    deadline = time.monotonic() + 120  # a hang guard: each wait takes seconds
    while not condition():
        assert all(proc.poll() is None for proc in procs), f"a group ended before the groups were {what}:\n{_logs(out)}"
        assert time.monotonic() < deadline, f"the groups were not {what} in 120 s:\n{_logs(out)}"
        time.sleep(0.05)


def _wait_for_the_end(procs: list[subprocess.Popen[str]], out: Path) -> None:
    for group, proc in enumerate(procs):
        assert proc.wait(timeout=150) == 0, f"group {group} failed:\n{_logs(out)}"  # a hang guard: seconds when idle


def _logs(out: Path) -> str:
    return "\n".join((out / f"group-{group}.log").read_text()[-2000:] for group in (0, 1))


def _distance(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert sorted(first) == sorted(second)
    return max((first[name] - second[name]).abs().max().item() for name in first)


# A run takes a few seconds when idle; 180 s is far above 10x that (a hang guard only).
@pytest.mark.timeout(180)
@pytest.mark.parametrize("inside", ["", "fsdp"], ids=["diloco", "diloco_fsdp-2-processes-per-group"])
def test_two_groups_end_where_one_process_simulating_diloco_ends(lighthouse_of_two: str, tmp_path: Path, inside: str) -> None:
    first, second = _run_groups(lighthouse_of_two, tmp_path, "4", "0.7", "0.9", "1", *[inside] if inside else [])
    if inside == "fsdp":  # a sharded checkpoint between syncs (after step 6) resumes exactly
        for group, straight in enumerate((first, second)):
            assert _distance(torch.load(tmp_path / f"resumed-{group}.pt", weights_only=True), straight) == 0.0
    assert _distance(first, second) == 0.0  # both groups hold the outer step's result
    assert [(tmp_path / f"steps-{g}").read_text() for g in (0, 1)] == ["6", "6"]  # 24 inner steps, H=4
    train = _load("diloco_train")
    assert _distance(first, train.simulate(4, 0.7, 0.9)[0]) < 1e-5
    # planted faults in the simulation: each moves it far from the run
    assert _distance(first, train.simulate(4, 0.7, 0.0)[0]) > 1e-3, "outer momentum dropped"
    assert _distance(first, train.simulate(4, 0.7, 0.9, sign=-1.0)[0]) > 1e-3, "pseudo-gradient sign flipped"
    assert _distance(first, train.simulate(4, 1.0, 0.0)[0]) > 1e-3, "plain averaging (LocalSGD)"


@pytest.mark.timeout(180)  # hang guard, as above
def test_h1_with_an_outer_sgd_at_lr_1_is_plain_data_parallel_training(lighthouse_of_two: str, tmp_path: Path,
                                                                      plain_run: Callable[[Path], None]) -> None:
    first, second = _run_groups(lighthouse_of_two, tmp_path, "1", "1.0", "0.0", "1")
    assert _distance(first, second) == 0.0
    plain_run(tmp_path)  # ft_train's plain loop: one process over whole global batches, same inner SGD
    plain = torch.load(tmp_path / "weights-plain.pt", weights_only=True)
    assert _distance(first, plain) < 1e-5
    train = _load("diloco_train")
    assert _distance(first, train.simulate(1, 1.0, 0.0)[0]) < 1e-5
    assert _distance(first, train.simulate(1, 1.0, 0.0, sign=-1.0)[0]) > 1e-3, "pseudo-gradient sign flipped"


@pytest.mark.timeout(180)  # hang guard, as above
@pytest.mark.parametrize("delay", [0, 1], ids=["no-delay", "fragment-sync-delay-1"])
def test_streaming_diloco_with_two_fragments_ends_where_its_simulation_ends(lighthouse_of_two: str, tmp_path: Path,
                                                                           delay: int) -> None:
    first, second = _run_groups(lighthouse_of_two, tmp_path, "4", "0.7", "0.9", "2", f"delay={delay}")
    # the last sync (step 24) was the second fragment's (the last layer); the first trained alone since
    assert all(torch.equal(first[name], second[name]) for name in ("2.weight", "2.bias"))
    # a fragment syncs every 2 steps, in turn: 12 outer steps over 24 inner steps
    assert [(tmp_path / f"steps-{g}").read_text() for g in (0, 1)] == ["12", "12"]
    train = _load("diloco_train")
    simulated = train.simulate(4, 0.7, 0.9, fragments=2, delay=delay)  # group g took the g-th half of every batch
    assert _distance(first, simulated[0]) < 1e-5 and _distance(second, simulated[1]) < 1e-5
    assert _distance(first, train.simulate(4, 0.7, 0.9)[0]) > 1e-3, "the whole model synced every 4 steps"
    other = train.simulate(4, 0.7, 0.9, fragments=2, delay=1 - delay)[0]
    assert _distance(first, other) > 1e-3, "the pseudo-gradients taken at the sync (tau 0) or a step before (tau 1)"


@pytest.mark.timeout(180)  # hang guard, as above
def test_local_sgd_averages_the_groups_weights(lighthouse_of_two: str, tmp_path: Path) -> None:
    first, second = _run_groups(lighthouse_of_two, tmp_path, "4", "1.0", "0.0", "1", "local_sgd")
    assert _distance(first, second) == 0.0
    assert [(tmp_path / f"steps-{g}").read_text() for g in (0, 1)] == ["6", "6"]
    train = _load("diloco_train")
    assert _distance(first, train.simulate(4, 1.0, 0.0)[0]) < 1e-5  # averaging is an outer SGD at lr 1
    assert _distance(first, train.simulate(4, 0.7, 0.9)[0]) > 1e-3, "DiLoCo's outer Nesterov step"


# About 15 s when idle (two starts of group 1); 240 s is a hang guard only.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("plant", ["", "no-outer-heal"], ids=["healed", "planted-heal-without-outer-optimizer"])
def test_a_group_killed_between_outer_syncs_heals_from_its_peer_and_both_end_equal(lighthouse: str,
                                                                                 tmp_path: Path, plant: str) -> None:
    """Group 1 is SIGKILLed after inner step 6, between the outer syncs at 4 and 8. Group 0 goes on
    alone (syncing with itself at 8 and 12) and waits after step 12 until group 1, started again,
    has trained 4 inner steps from the start of its data and asked the lighthouse for a quorum;
    group 0 joins it at step 16. (Asked first, group 0 would sync alone again: the lighthouse
    forms a quorum at once when the last one's groups are all there.) Group 1 heals there from
    group 0: the model, the inner optimizer, the outer optimizer and the last synchronised
    weights, the loader's position and the step count. Both end bit-identical, and where the
    algorithm's simulation with group 1's lost steps ends. With a planted fault (the healed group
    keeps its own outer optimizer state) they do not."""
    out, args = tmp_path, ("4", "0.7", "0.9", "1", *([f"plant={plant}"] if plant else []))
    (out / "gate").touch()
    _hold(out, 1, 6)
    procs = [_start(group, lighthouse, out, args, FT_STEP_SLEEP="0.1") for group in (0, 1)]
    with killing_leftovers(procs):
        _wait_until_ready(out, procs)
        (out / "gate").unlink()
        _wait(lambda: _batches(out, 1)[-1:] == [6], procs, out, "at step 6")
        _hold(out, 0, 12)  # set before the kill: group 0 cannot run to the end while group 1 is down
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        (out / "hold-1").unlink()  # its second life runs free
        _wait(lambda: _batches(out, 0)[-1:] == [12], procs[:1], out, "at step 12")
        procs[1] = _start(1, lighthouse, out, args, FT_STEP_SLEEP="0.1")
        # the lighthouse holds group 1's request (one of two live groups) until group 0 asks too
        _wait(lambda: "[1/1 participants healthy]" in _lighthouse_status(lighthouse), procs, out,
              "asked for a quorum by group 1's second life")
        (out / "hold-0").unlink()
        _wait_for_the_end(procs, out)
    survivor, victim = _records(out, 0), _records(out, 1)
    assert [batch for batch, _, _ in survivor] == list(range(1, 25)) and len({pid for *_, pid in survivor}) == 1
    second_life = [batch for batch, _, pid in victim if pid == procs[1].life]
    # 4 inner steps from its own start, then on from group 0's position after the sync at 16
    assert second_life == [1, 2, 3, 4, *range(17, 25)], second_life
    assert [(out / f"heals-{g}").read_text() for g in (0, 1)] == ["0", "1"]
    assert [(out / f"steps-{g}").read_text() for g in (0, 1)] == ["6", "6"]
    first, second = (torch.load(out / f"weights-{g}.pt", weights_only=True) for g in (0, 1))
    if plant:  # the fault is seen: the healed group's outer steps differ from its peer's
        assert _distance(first, second) > 1e-3
        return
    assert all(torch.equal(first[name], second[name]) for name in first)
    # what the failure changed: group 1's slices of steps 5-8 were lost, group 0 trained on whole
    # batches from 9 to 16 (the syncs at 8 and 12 had one group), and two groups again from 17
    train = _load("diloco_train")
    lost = [(2, 2), (2, 1), (1, 1), (1, 1), (2, 2), (2, 2)]  # (slices of a batch, groups alive) per interval
    assert _distance(first, train.simulate(4, 0.7, 0.9, schedule=lost)[0]) < 1e-5
    assert _distance(first, train.simulate(4, 0.7, 0.9)[0]) > 1e-3, "the failure changed nothing"


def _hold(out: Path, group: int, batch: int) -> None:
    """Group `group` waits between steps once it has trained global batch `batch`, until `hold-<group>` is removed."""
    part = out / f"hold-{group}.part"
    part.write_text(str(batch))
    part.replace(out / f"hold-{group}")  # the group never reads a half-written file


def _lighthouse_status(lighthouse: str) -> str:
    """The lighthouse's status page: its next quorum's state, with the groups that asked for it."""
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=10) as page:
        return page.read().decode()


def _records(out: Path, group: int) -> list[tuple[int, int, int]]:
    """(global batch, outer steps, pid) of each inner step the group took."""
    path = out / f"progress-{group}"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(batch), int(steps), int(pid)) for batch, steps, pid in (line.split() for line in lines)]


def _batches(out: Path, group: int) -> list[int]:
    return [batch for batch, _, _ in _records(out, group)]


def _saved_between_syncs_and_resumed(strategy: Callable[[], Any], path: str, lighthouse: str,
                                     monkeypatch: pytest.MonkeyPatch
                                     ) -> tuple[tuple[dict[str, torch.Tensor], int], tuple[dict[str, torch.Tensor], int]]:
    """One group in this process under `strategy()` (a sync every 4 inner steps) trains 6 steps, saves
    to `path` and trains 5 more; then loads `path` and trains those 5 again. The weights and the
    strategy's `step` where it went straight on, and where it resumed."""
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    x = torch.randn(32, 3, generator=torch.Generator().manual_seed(0))
    made = strategy()

    def train(lite: LightningLite) -> tuple[tuple[dict[str, torch.Tensor], int], ...]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        net, optimizer = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
        loader = lite.setup_dataloaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2))

        def steps(batches: Any, count: int) -> None:
            for _ in range(count):
                xs, ys = next(batches)
                optimizer.zero_grad()
                lite.backward(torch.nn.functional.mse_loss(net(xs), ys))
                optimizer.step()

        batches = iter(loader)
        steps(batches, 6)  # a sync at 4, two inner steps since
        lite.save({"model": net, "optimizer": optimizer}, path)
        steps(batches, 5)  # the next sync at 8, three inner steps since (not two, as saved)
        straight = {k: v.clone() for k, v in net.state_dict().items()}, lite.strategy.step
        lite.load(path, {"model": net, "optimizer": optimizer})
        steps(iter(loader), 5)
        return straight, ({k: v.clone() for k, v in net.state_dict().items()}, lite.strategy.step)

    try:
        return LightningLite(accelerator="cpu", strategy=made).launch(train)
    finally:
        made.teardown()  # the process group Lite made in this test's process


# One group in this process: a few seconds when idle; 90 s is a hang guard only.
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", [DiLoCoStrategy, LocalSGDStrategy])
def test_a_checkpoint_between_outer_syncs_resumes_exactly(lighthouse: str, tmp_path: Path, kind: type,
                                                          monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    path = str(tmp_path / "ckpt.pt")
    (straight, straight_steps), (resumed, resumed_steps) = _saved_between_syncs_and_resumed(
        lambda: kind(sync_every=4, ft_timeout=5), path, lighthouse, monkeypatch)
    assert straight_steps == resumed_steps == 2
    assert _distance(straight, resumed) == 0.0
    # the checkpoint loads under `ddp` for evaluation: the group's weights, the torchft state left over
    evaluated, leftover = LightningLite(accelerator="cpu", strategy="ddp", devices=1).launch(_load_for_evaluation, path)
    assert _distance(evaluated, torch.load(path, weights_only=True)["model"]) == 0.0
    assert {"_torchft_manager", "_torchft_diloco"} <= set(leftover)
    saved = torch.load(path, weights_only=True)["_torchft_diloco"]
    assert saved["local_step"] == 2
    if kind is LocalSGDStrategy:
        return
    fragment = saved["fragments"]["StreamingDiLoCoFragment_0"]
    assert len(fragment["original_parameters"]) == 4  # the weights of the last outer step
    assert all("momentum_buffer" in s for s in fragment["outer_optimizer"]["state"].values())


# One group in this process, no step taken: a second or two; 90 s is a hang guard only.
@pytest.mark.timeout(90)
def test_the_options_reach_torchfts_diloco(lighthouse: str, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    """What `DiLoCoStrategy` is given is what torchft's `DiLoCo` runs with (quantized all-reduce
    runs only on a GPU, so here it is seen passed on, not run: the check that refuses it on a
    CPU stands aside, as on a CUDA machine with Triton)."""
    import lite_torchft.diloco

    monkeypatch.setattr(lite_torchft.diloco, "_require_quantizing_kernels", lambda strategy, accelerator: None)
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    outer = []

    def adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        outer.append(torch.optim.Adam(params, lr=0.01))
        return outer[-1]

    strategy = DiLoCoStrategy(sync_every=6, fragments=2, fragment_sync_delay=2, fragment_update_alpha=0.25,
                              should_quantize=True, outer_optimizer=adam, ft_timeout=5)

    def set_up(lite: LightningLite) -> None:
        net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))

    try:
        LightningLite(accelerator="cpu", strategy=strategy).launch(set_up)
        algorithm = strategy._algorithm
        assert algorithm._sync_every == 3 and algorithm._fragment_sync_delay == 2  # per fragment: 6 / 2
        fragments = algorithm._fragments
        assert [f._outer_optimizer for f in fragments] == outer and len(outer) == 2
        assert all(f.should_quantize and f._fragment_update_alpha == 0.25 for f in fragments)
    finally:
        strategy.teardown()


def _load_for_evaluation(lite: LightningLite, path: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A fresh model of the same shape, set up under this `lite`, with the checkpoint at `path`
    loaded into it; and the keys of the checkpoint that `load` handed back."""
    net = lite.setup(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    leftover = lite.load(path, {"model": net})
    return {k: v.clone() for k, v in net.state_dict().items()}, list(leftover)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sync_every": 0}, r"sync_every=0 must be a whole number of inner steps, 1 or more"),
    ({"sync_every": 4, "fragments": 3}, r"fragments=3 must be a whole number that divides sync_every=4"),
    ({"sync_every": 4, "fragments": 2, "fragment_sync_delay": 2}, r"fragment_sync_delay=2 must be .* below .* = 2"),
])
def test_a_bad_schedule_is_refused_at_construction(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        DiLoCoStrategy(**kwargs)


def test_the_names_are_registered_as_entry_points() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    strategies = pyproject["project"]["entry-points"]["lite_core.strategies"]
    assert strategies["diloco"] == "lite_torchft.diloco:DiLoCoStrategy" and DiLoCoStrategy.name == "diloco"
    assert strategies["diloco_fsdp"] == "lite_torchft.diloco:DiLoCoFSDPStrategy"
    assert DiLoCoFSDPStrategy.name == "diloco_fsdp"
    assert strategies["local_sgd"] == "lite_torchft.diloco:LocalSGDStrategy" and LocalSGDStrategy.name == "local_sgd"
