"""The fault-tolerance algorithm interface (`lite_torchft.Algorithm`): a toy algorithm written on
it (tests/scripts/pull_to_average.py, which docs/backends/torchft.md shows word for word) runs on
two real replica groups and computes what one process simulating it computes; its checkpoint
state resumes exactly; and the page's example is that file.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.functional import mse_loss

from lite_core.plugins import ConfigurationError
from lite_torchft import Algorithm, AlgorithmStrategy


def _module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


_diloco = _module(Path(__file__).with_name("test_diloco.py"))  # the DiLoCo tests' two-group runner and helpers
SCRIPTS, _distance, _load, _run_groups = _diloco.SCRIPTS, _diloco._distance, _diloco._load, _diloco._run_groups
_saved_between_syncs_and_resumed = _diloco._saved_between_syncs_and_resumed
ROOT = Path(__file__).resolve().parents[3]


def simulate(sync_every: int, pull: float, groups: int = 2) -> list[dict[str, torch.Tensor]]:
    """PullToAverage in one process: `groups` models, each on its slice of every global batch with
    the inner SGD; every `sync_every` steps each moves `pull` of the way to the models' average."""
    train = _load("diloco_train")
    nets = [train.model() for _ in range(groups)]
    optimizers = [train.inner_optimizer(net) for net in nets]
    for step, (x, y, _) in enumerate(train.data(), start=1):
        for net, optimizer, xs, ys in zip(nets, optimizers, x.tensor_split(groups), y.tensor_split(groups)):
            optimizer.zero_grad()
            mse_loss(net(xs), ys).backward()
            optimizer.step()
        if step % sync_every == 0:
            with torch.no_grad():
                for parameters in zip(*(net.parameters() for net in nets)):
                    average = sum(p.clone() for p in parameters) / groups
                    for parameter in parameters:
                        parameter.lerp_(average, pull)
    return [net.state_dict() for net in nets]


# A run takes a few seconds when idle; 180 s is far above 10x that (a hang guard only).
@pytest.mark.timeout(180)
def test_a_toy_algorithm_on_the_public_interface_runs_on_two_groups(lighthouse_of_two: str, tmp_path: Path) -> None:
    """Two groups (diloco_train.py with `AlgorithmStrategy(PullToAverage(4, 0.25))`) over the
    DiLoCo tests' loop: every 4 inner steps each moves a quarter of the way to the average."""
    first, second = _run_groups(lighthouse_of_two, tmp_path, "4", "0", "0", "1", "pull=0.25")
    assert [(tmp_path / f"steps-{g}").read_text() for g in (0, 1)] == ["6", "6"]  # 6 committed syncs, 24 steps
    simulated = simulate(4, 0.25)
    assert _distance(first, simulated[0]) < 1e-5 and _distance(second, simulated[1]) < 1e-5
    assert _distance(first, second) > 1e-3  # a pull short of 1 leaves the groups apart
    # planted faults in the simulation: each moves it far from the run
    assert _distance(first, simulate(4, 0.0)[0]) > 1e-3, "the groups never met"
    assert _distance(first, simulate(4, 1.0)[0]) > 1e-3, "plain averaging (LocalSGD)"
    assert _distance(first, simulate(2, 0.25)[0]) > 1e-3, "sync_every not kept"


# One group in this process: a few seconds when idle; 90 s is a hang guard only.
@pytest.mark.timeout(90)
def test_the_toy_algorithms_state_resumes_between_syncs(lighthouse: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    """A checkpoint after inner step 6 (a sync at 4) holds the algorithm's `state_dict`; loading it
    and training on ends where the run that went straight on ended (the next sync at 8, not 10)."""
    algorithm = _load("pull_to_average").PullToAverage(sync_every=4, pull=0.5)
    syncs = []
    sync = algorithm.after_step
    algorithm.after_step = lambda: (syncs.append(algorithm.inner_steps + 1 == 4), sync())[1]  # type: ignore[method-assign]
    path = str(tmp_path / "ckpt.pt")
    (straight, _), (resumed, _) = _saved_between_syncs_and_resumed(
        lambda: AlgorithmStrategy(algorithm, ft_timeout=5), path, lighthouse, monkeypatch)
    assert len(syncs) == 16  # the hook ran at each inner step
    # syncs at 4 and 8, then at 8 again after the load (2 inner steps in); one group's sync leaves
    # its weights as they are, so only the count sees a lost `inner_steps`
    assert syncs.count(True) == 3 and syncs[11:] == [False, True, False, False, False]
    assert torch.load(path, weights_only=True)["_torchft_diloco"] == {"inner_steps": 2}
    assert _distance(straight, resumed) == 0.0


def test_the_docs_example_is_the_tested_algorithm() -> None:
    page = (ROOT / "docs" / "backends" / "torchft.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert (SCRIPTS / "pull_to_average.py").read_text(encoding="utf-8") in blocks


def test_a_strategy_takes_only_an_algorithm() -> None:
    with pytest.raises(ConfigurationError, match=r"AlgorithmStrategy takes a lite_torchft.Algorithm, not str:"
                                                 r" subclass lite_torchft.Algorithm and pass an instance\."):
        AlgorithmStrategy("diloco")  # type: ignore[arg-type]


def test_an_algorithm_without_build_names_the_hook() -> None:
    with pytest.raises(NotImplementedError, match=r"Algorithm must define build\(manager, model, optimizer\)\."):
        Algorithm(sync_every=2).build(None, torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=1.0))
