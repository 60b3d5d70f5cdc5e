"""Every strategy and precision in this repository that overrides a routed method declares, in its
own class body, the attribute that says what the override changes (docs/backends/writing.md,
"Declare what your overrides change"): Lite reads only the attribute, so an override without it
would silently keep the plain routing and never run where one process is plain.

The check imports every strategy the packages register (and so their precisions) in a separate
process, with each package's `src` on the path, as `test_layers.py` reads them; the backends'
own libraries (torch-xla, DeepSpeed, torchft) are imported only when a strategy runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lite-core", "lite-cuda", "lite-xla", "lite-deepspeed", "lite-torchft")
#: Routed method -> the attribute a class that overrides it declares, per base class.
ROUTED = {
    "Strategy": {"backward": "changes_backward", "batch_to_device": "moves_batches_plainly",
                 "optimizer_step": "steps_optimizers_plainly", "call_module_method": "routes_module_methods",
                 "load_module_state_dict": "routes_load_state_dict",
                 "module_named_parameters": "routes_named_parameters", "save_checkpoint": "stages_checkpoints",
                 "stage_checkpoint": "stages_checkpoints"},
    "Precision": {"backward": "changes_backward", "optimizer_step": "changes_optimizer_step"},
}


def undeclared(cls: type, base: str) -> list[str]:
    """`module.Class.method needs attribute` for each routed method of `base` that `cls` defines in
    its own body without the attribute beside it."""
    own = vars(cls)
    return [f"{cls.__module__}.{cls.__qualname__}.{method} needs {attribute}"
            for method, attribute in ROUTED[base].items() if method in own and attribute not in own]


def repository_report() -> list[str]:
    """`undeclared` over every class of the repository's packages under a registered strategy's MRO
    (mixins included) and every precision they define; run with the packages importable."""
    import importlib

    from lite_core.plugins import Precision, Strategy

    for name in PACKAGES:
        pyproject = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text(encoding="utf-8"))
        for target in pyproject["project"].get("entry-points", {}).get("lite_core.strategies", {}).values():
            importlib.import_module(target.partition(":")[0])
    ours = tuple(name.replace("-", "_") for name in PACKAGES)
    classes = {(c, "Strategy") for s in _subclasses(Strategy) for c in s.__mro__ if c not in (Strategy, object)}
    classes |= {(c, "Precision") for c in _subclasses(Precision)}
    return sorted(problem for cls, base in classes if cls.__module__.partition(".")[0] in ours
                  for problem in undeclared(cls, base))


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(_subclasses(sub) for sub in found))


@pytest.mark.timeout(120)  # a hang guard: the process imports torch and every strategy module (~5 s)
def test_every_strategy_and_precision_declares_what_its_overrides_change() -> None:
    path = os.pathsep.join([str(ROOT / "packages" / name / "src") for name in PACKAGES] + [str(Path(__file__).parent)])
    code = f"import json; from {Path(__file__).stem} import repository_report; print(json.dumps(repository_report()))"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path}, capture_output=True,
                            text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    problems = json.loads(result.stdout.splitlines()[-1])
    assert problems == [], f"declare what each override changes (docs/backends/writing.md): {problems}"


def test_an_override_without_its_declaration_is_named() -> None:
    from lite_core.plugins import Precision, SingleDeviceStrategy

    class Moving(SingleDeviceStrategy):
        def batch_to_device(self, batch):  # type: ignore[no-untyped-def]
            return batch

    class Declared(Moving):
        moves_batches_plainly = False

        def batch_to_device(self, batch):  # type: ignore[no-untyped-def]
            return batch

    class Scaling(Precision):
        changes_backward = True

        def backward(self, tensor, module, *args, **kwargs):  # type: ignore[no-untyped-def]
            tensor.backward()

        def optimizer_step(self, optimizer, **kwargs):  # type: ignore[no-untyped-def]
            return optimizer.step()

    assert [p.rpartition(".")[2] for p in undeclared(Moving, "Strategy")] == ["batch_to_device needs moves_batches_plainly"]
    assert undeclared(Declared, "Strategy") == []
    assert [p.rpartition(".")[2] for p in undeclared(Scaling, "Precision")] == ["optimizer_step needs changes_optimizer_step"]
