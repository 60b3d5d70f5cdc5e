"""The built wheels installed (not editable) into a fresh venv behave as the README promises.

Every test here runs programs in the venv of tests/packaging/conftest.py: `lite-core` alone,
then `lite-core[deepspeed]` after DeepSpeed's documented precondition, then `lite-core[cuda]`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

pytestmark = pytest.mark.timeout(600)  # the first test pays for the venv: torch, then DeepSpeed's build
BACKENDS = ("lite-cuda", "lite-deepspeed", "lite-xla")
FAKE_BACKEND = Path(__file__).resolve().parents[1] / "fake_backend"


def _installed_by(report: dict[str, Any]) -> dict[str, str]:
    """What one `pip install --report` installed: canonical name -> the URL it came from."""
    return {item["metadata"]["name"].lower(): item["download_info"]["url"] for item in report["install"]}


def _assert_from_local_wheel(installed: dict[str, Any], report: dict[str, Any], name: str, wheel: Path,
                             venv_root: Path) -> None:
    """`name` was installed by that report from `wheel`, as a regular (non-editable) install in the venv."""
    assert _installed_by(report).get(name) == wheel.as_uri(), report["install"]
    found = installed[name]
    assert found["direct_url"] is None or not found["direct_url"].get("dir_info", {}).get("editable")
    assert Path(found["location"]).resolve().is_relative_to(venv_root.resolve()), found


def test_lite_core_alone_brings_no_backend(core_alone: dict[str, Any], fresh_venv: Any,
                                           wheel_of: Callable[[str], Path]) -> None:
    assert _installed_by(core_alone["report"]) == {"lite-core": wheel_of("lite-core").as_uri()}
    _assert_from_local_wheel(core_alone["installed"], core_alone["report"], "lite-core", wheel_of("lite-core"),
                             fresh_venv.root)
    assert [name for name in (*BACKENDS, "deepspeed", "torch-xla") if name in core_alone["installed"]] == []
    assert core_alone["installed"]["torch"]["version"].startswith("2.13.0")


_DDP_SAVE = """
import json, os, sys, tempfile
import torch
from lite_core import LightningLite


def main(lite):
    model = lite.setup(torch.nn.Linear(2, 2))
    path = lite.broadcast(os.path.join(tempfile.mkdtemp(), "ckpt.pt") if lite.is_global_zero else None)
    lite.save({"model": model, "step": 3}, path)  # rank 0 tells the others how the write went
    return lite.load(path)["step"]


if __name__ == "__main__":
    lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2)
    step = lite.launch(main)
    if lite.is_global_zero:
        print(json.dumps({"step": step}))
"""


_REQUIRES = """
import json
from importlib.metadata import requires
from packaging.requirements import Requirement
print(json.dumps(sorted(Requirement(r).name for r in requires("lite-core") if "extra ==" not in r)))
"""


def test_lite_core_alone_saves_under_ddp_with_what_it_declares(core_alone: dict[str, Any], fresh_venv: Any,
                                                               tmp_path: Path) -> None:
    """torch's object collectives need numpy, which torch does not bring: lite-core declares it (a
    first blocking save under ddp died on rank 1 with 'Numpy is not available'), and the venv, which
    holds only torch and lite-core's declared requirements, saves under ddp."""
    assert fresh_venv.python(_REQUIRES) == ["fsspec", "numpy", "packaging", "torch"]
    script = tmp_path / "ddp_save.py"
    script.write_text(_DDP_SAVE)
    assert fresh_venv.script(script, LITE_COLLECTIVE_TIMEOUT="60") == {"step": 3}


def test_deepspeed_extra_brings_lite_deepspeed_from_its_wheel(deepspeed_extra: dict[str, Any], fresh_venv: Any,
                                                               wheel_of: Callable[[str], Path]) -> None:
    # lite-core is already there: the extra adds exactly the backend, from the local wheel.
    assert _installed_by(deepspeed_extra["report"]) == {"lite-deepspeed": wheel_of("lite-deepspeed").as_uri()}
    _assert_from_local_wheel(deepspeed_extra["installed"], deepspeed_extra["report"], "lite-deepspeed",
                             wheel_of("lite-deepspeed"), fresh_venv.root)
    assert deepspeed_extra["installed"]["deepspeed"]["version"] == "0.19.8"


_RESOLVE = """
import json, sys
from pathlib import Path
from lite_core._registry import STRATEGIES
found = {name: str(Path(sys.modules[STRATEGIES.load(name).__module__].__file__)) for name in sys.argv[1:]}
print(json.dumps(found))
"""


def test_deepspeed_strategies_resolve_through_the_installed_entry_points(
    deepspeed_extra: dict[str, Any], fresh_venv: Any, packages: dict[str, Path], build_tool: ModuleType
) -> None:
    declared = build_tool.read_pyproject(packages["lite-deepspeed"])["project"]["entry-points"]["lite_core.strategies"]
    files = fresh_venv.python(_RESOLVE, *declared)
    assert sorted(files) == sorted(declared)
    site = Path(deepspeed_extra["installed"]["lite-deepspeed"]["location"])
    assert all(Path(path).is_relative_to(site / "lite_deepspeed") for path in files.values()), files


_CONSTRUCT = """
import json
from lite_core import LightningLite
lite = LightningLite(accelerator="cpu", strategy="deepspeed_stage_2", devices=1)
strategy = type(lite.strategy)
print(json.dumps({"class": f"{strategy.__module__}.{strategy.__qualname__}", "stage": lite.strategy.stage}))
"""


def test_lightning_lite_constructs_a_deepspeed_strategy_by_name(deepspeed_extra: dict[str, Any],
                                                                fresh_venv: Any) -> None:
    assert fresh_venv.python(_CONSTRUCT) == {"class": "lite_deepspeed.presets.DeepSpeedStage2", "stage": 2}


def test_lite_env_lists_the_installed_backends(deepspeed_extra: dict[str, Any], cuda_extra: dict[str, Any],
                                               fresh_venv: Any) -> None:
    report = json.loads(fresh_venv.command("lite", "env", "--json").stdout)
    packages = {package["name"]: package for package in report["packages"]}
    assert packages["lite-deepspeed"]["compatible"] is True
    assert "deepspeed_stage_3_offload" in packages["lite-deepspeed"]["strategies"]
    assert packages["lite-cuda"]["compatible"] is True
    assert [a["name"] for a in packages["lite-cuda"]["accelerators"]] == ["cuda", "gpu"]
    assert "ddp" in packages["lite-core"]["strategies"]


def test_cuda_extra_brings_lite_cuda_from_its_wheel(cuda_extra: dict[str, Any], fresh_venv: Any,
                                                     wheel_of: Callable[[str], Path]) -> None:
    assert _installed_by(cuda_extra["report"]) == {"lite-cuda": wheel_of("lite-cuda").as_uri()}
    _assert_from_local_wheel(cuda_extra["installed"], cuda_extra["report"], "lite-cuda", wheel_of("lite-cuda"),
                             fresh_venv.root)
    assert "lite-xla" not in cuda_extra["installed"]


# --- a backend whose declared lite-core range excludes the installed core -------------------------

_REFUSED = """
import json, sys
from lite_core import LightningLite
try:
    LightningLite(accelerator="fake", devices=1)
except Exception as err:
    print(json.dumps({"error": type(err).__name__, "message": str(err),
                      "imported": "lite_fake_backend.accelerator" in sys.modules}))
else:
    print(json.dumps({"error": None}))
"""


def _build_fake_backend(version: str, core_range: str, build_tool: ModuleType, tmp_path: Path) -> Path:
    """A throwaway copy of tests/fake_backend with another version and `lite-core` range, built to a wheel."""
    source = shutil.copytree(FAKE_BACKEND, tmp_path / "fake_backend")
    pyproject = source / "pyproject.toml"
    text = pyproject.read_text()
    changed = text.replace('version = "0.0.1"', f'version = "{version}"').replace(
        '"lite-core>=0.1,<0.2"', f'"lite-core{core_range}"')
    assert changed.count(version) == 1 and changed.count(core_range) == 1, "tests/fake_backend changed its pyproject"
    pyproject.write_text(changed)
    build_tool.build(source, tmp_path / "dist")
    return tmp_path / "dist" / f"lite_fake_backend-{version}-py3-none-any.whl"


@pytest.mark.parametrize(
    ("core_range", "fix"),
    [
        (">=9", "pip install --upgrade 'lite-core>=9'"),  # a backend made for a newer core
        ("<0.1", "pip install --upgrade lite-fake-backend"),  # a backend left behind by the core
    ],
    ids=["backend-needs-newer-core", "backend-older-than-core"],
)
def test_backend_whose_lite_core_range_excludes_the_core_is_refused_with_the_upgrade_line(
    core_alone: dict[str, Any], fresh_venv: Any, build_tool: ModuleType, packages: dict[str, Path],
    tmp_path: Path, core_range: str, fix: str,
) -> None:
    version = "0.0.9" if core_range.startswith(">") else "0.0.8"
    wheel = _build_fake_backend(version, core_range, build_tool, tmp_path)
    # --no-deps: pip would refuse the range itself; the core must refuse what got installed anyway.
    fresh_venv.pip("install", "--no-deps", "--force-reinstall", str(wheel))
    core = build_tool.package_version(packages["lite-core"])
    sentence = (f"lite-fake-backend {version} needs lite-core{core_range} but lite-core {core} is installed:"
                f" run `{fix}`.")
    assert fresh_venv.python(_REFUSED) == {"error": "IncompatibleBackendError", "message": sentence,
                                           "imported": False}
    listed = json.loads(fresh_venv.command("lite", "env", "--json").stdout)["packages"]
    assert {"name": "lite-fake-backend", "compatible": False, "problem": sentence} in [
        {key: package[key] for key in ("name", "compatible", "problem")} for package in listed]
