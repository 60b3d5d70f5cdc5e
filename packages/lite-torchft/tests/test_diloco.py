"""`strategy="diloco"`: two replica groups on loopback compute the DiLoCo algorithm exactly.

The test starts the lighthouse (in this process) and both groups (tests/scripts/diloco_train.py,
one process each, `split_batches=True`, no failure). Their weights must equal one plain process
that simulates the algorithm (`diloco_train.simulate`), and with H=1, an outer SGD at lr 1 without
momentum, one plain data-parallel process (`ft_train.plain`). The simulation with the outer
momentum dropped, or the pseudo-gradient's sign flipped, must not match: the comparison sees them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import free_port, script_env  # the repository's conftest.py
from lite_core import LightningLite
from lite_core.plugins import ConfigurationError
from lite_torchft.diloco import DiLoCoStrategy, LocalSGDStrategy

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
    procs = []
    for group in (0, 1):
        env = script_env(REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2", TORCHFT_LIGHTHOUSE=lighthouse,
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        log = (out / f"group-{group}.log").open("w")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / "diloco_train.py"), str(out), *args], env=env,
                                      text=True, stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 120  # a hang guard: set-up takes seconds
        while not all(any(out.glob(f"ready-{group}-{proc.pid}")) for group, proc in enumerate(procs)):
            assert all(proc.poll() is None for proc in procs), f"a group ended before it was set up:\n{_logs(out)}"
            assert time.monotonic() < deadline, f"the groups were not set up in 120 s:\n{_logs(out)}"
            time.sleep(0.05)
        (out / "gate").unlink()
        for group, proc in enumerate(procs):
            assert proc.wait(timeout=150) == 0, f"group {group} failed:\n{(out / f'group-{group}.log').read_text()[-4000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [torch.load(out / f"weights-{group}.pt", weights_only=True) for group in (0, 1)]


def _logs(out: Path) -> str:
    return "\n".join((out / f"group-{group}.log").read_text()[-2000:] for group in (0, 1))


def _distance(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert sorted(first) == sorted(second)
    return max((first[name] - second[name]).abs().max().item() for name in first)


# A run takes a few seconds when idle; 180 s is far above 10x that (a hang guard only).
@pytest.mark.timeout(180)
def test_two_groups_end_where_one_process_simulating_diloco_ends(lighthouse: str, tmp_path: Path) -> None:
    first, second = _run_groups(lighthouse, tmp_path, "4", "0.7", "0.9", "1")
    assert _distance(first, second) == 0.0  # both groups hold the outer step's result
    assert [(tmp_path / f"steps-{g}").read_text() for g in (0, 1)] == ["6", "6"]  # 24 inner steps, H=4
    train = _load("diloco_train")
    assert _distance(first, train.simulate(4, 0.7, 0.9)[0]) < 1e-5
    # planted faults in the simulation: each moves it far from the run
    assert _distance(first, train.simulate(4, 0.7, 0.0)[0]) > 1e-3, "outer momentum dropped"
    assert _distance(first, train.simulate(4, 0.7, 0.9, sign=-1.0)[0]) > 1e-3, "pseudo-gradient sign flipped"
    assert _distance(first, train.simulate(4, 1.0, 0.0)[0]) > 1e-3, "plain averaging (LocalSGD)"


@pytest.mark.timeout(180)  # hang guard, as above
def test_h1_with_an_outer_sgd_at_lr_1_is_plain_data_parallel_training(lighthouse: str, tmp_path: Path,
                                                                      plain_run: Callable[[Path], None]) -> None:
    first, second = _run_groups(lighthouse, tmp_path, "1", "1.0", "0.0", "1")
    assert _distance(first, second) == 0.0
    plain_run(tmp_path)  # ft_train's plain loop: one process over whole global batches, same inner SGD
    plain = torch.load(tmp_path / "weights-plain.pt", weights_only=True)
    assert _distance(first, plain) < 1e-5
    train = _load("diloco_train")
    assert _distance(first, train.simulate(1, 1.0, 0.0)[0]) < 1e-5
    assert _distance(first, train.simulate(1, 1.0, 0.0, sign=-1.0)[0]) > 1e-3, "pseudo-gradient sign flipped"


@pytest.mark.timeout(180)  # hang guard, as above
def test_streaming_diloco_with_two_fragments_ends_where_its_simulation_ends(lighthouse: str, tmp_path: Path) -> None:
    first, second = _run_groups(lighthouse, tmp_path, "4", "0.7", "0.9", "2")
    # the last sync (step 24) was the second fragment's (the last layer); the first trained alone since
    assert all(torch.equal(first[name], second[name]) for name in ("2.weight", "2.bias"))
    # a fragment syncs every 2 steps, in turn: 12 outer steps over 24 inner steps
    assert [(tmp_path / f"steps-{g}").read_text() for g in (0, 1)] == ["12", "12"]
    train = _load("diloco_train")
    simulated = train.simulate(4, 0.7, 0.9, fragments=2)  # group g took the g-th half of every batch
    assert _distance(first, simulated[0]) < 1e-5 and _distance(second, simulated[1]) < 1e-5
    assert _distance(first, train.simulate(4, 0.7, 0.9)[0]) > 1e-3, "the whole model synced every 4 steps"


@pytest.mark.timeout(180)  # hang guard, as above
def test_local_sgd_averages_the_groups_weights(lighthouse: str, tmp_path: Path) -> None:
    first, second = _run_groups(lighthouse, tmp_path, "4", "1.0", "0.0", "1", "local_sgd")
    assert _distance(first, second) == 0.0
    assert [(tmp_path / f"steps-{g}").read_text() for g in (0, 1)] == ["6", "6"]
    train = _load("diloco_train")
    assert _distance(first, train.simulate(4, 1.0, 0.0)[0]) < 1e-5  # averaging is an outer SGD at lr 1
    assert _distance(first, train.simulate(4, 0.7, 0.9)[0]) > 1e-3, "DiLoCo's outer Nesterov step"


# One group in this process: a few seconds when idle; 90 s is a hang guard only.
@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", [DiLoCoStrategy, LocalSGDStrategy])
def test_a_checkpoint_between_outer_syncs_resumes_exactly(lighthouse: str, tmp_path: Path, kind: type,
                                                          monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    path = str(tmp_path / "ckpt.pt")
    x = torch.randn(32, 3, generator=torch.Generator().manual_seed(0))

    def train(lite: LightningLite) -> tuple[dict[str, torch.Tensor], ...]:
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
        steps(batches, 6)  # an outer step at 4, two inner steps since
        lite.save({"model": net, "optimizer": optimizer}, path)
        steps(batches, 5)  # the next outer step at 8, three inner steps since (not two, as saved)
        straight = {k: v.clone() for k, v in net.state_dict().items()}, lite.strategy.step
        lite.load(path, {"model": net, "optimizer": optimizer})
        steps(iter(loader), 5)
        return straight, ({k: v.clone() for k, v in net.state_dict().items()}, lite.strategy.step)

    strategy = kind(sync_every=4, ft_timeout=5)
    try:
        (straight, straight_steps), (resumed, resumed_steps) = LightningLite(accelerator="cpu", strategy=strategy).launch(train)
    finally:
        strategy.teardown()  # the Manager would go on heartbeating to this test's lighthouse
    assert straight_steps == resumed_steps == 2
    assert _distance(straight, resumed) == 0.0
    saved = torch.load(path, weights_only=True)["_torchft_diloco"]
    assert saved["local_step"] == 2
    if kind is LocalSGDStrategy:
        return
    fragment = saved["fragments"]["StreamingDiLoCoFragment_0"]
    assert len(fragment["original_parameters"]) == 4  # the weights of the last outer step
    assert all("momentum_buffer" in s for s in fragment["outer_optimizer"]["state"].values())


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
    assert strategies["local_sgd"] == "lite_torchft.diloco:LocalSGDStrategy" and LocalSGDStrategy.name == "local_sgd"
