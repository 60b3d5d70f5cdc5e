"""Fixtures that build the packages' wheels and install them into a fresh virtual environment.

The session builds every package once (`tools/build_all.py`, i.e. `hatch build` in each package
directory) and creates one fresh venv (no system site-packages) with the pinned `torch==2.13.0`.
The installs then happen in a fixed order, each a session fixture that records what it did:
`lite-core` alone, then DeepSpeed (the documented precondition) and `lite-core[deepspeed]`,
then `lite-core[cuda]`. Every Lite distribution comes from the local wheels (`--no-index`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import venv as venv_module
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
DEEPSPEED = "deepspeed==0.19.8"
#: Seconds one pip command may take (torch from local disk, DeepSpeed built once then cached).
PIP_TIMEOUT = 420
#: Seconds one Python program in the venv may take (importing DeepSpeed is the slow part).
PYTHON_TIMEOUT = 120
# Variables of the surrounding hatch environment that would leak it into the fresh venv.
_OUTER_VARIABLES = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "HATCH_ENV_ACTIVE", "HATCH_PROJECT_ROOT",
                    "PIP_REQUIRE_VIRTUALENV", "PIP_TARGET", "PIP_PREFIX", "PIP_USER")


def load_build_tool() -> ModuleType:
    """`tools/build_all.py` as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("_lite_build_all", ROOT / "tools" / "build_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD_TOOL = load_build_tool()
PACKAGES: dict[str, Path] = BUILD_TOOL.workspace_packages()


def wheel_path(dist: Path, name: str) -> Path:
    """The wheel of the workspace package `name` in `dist` (its current version)."""
    version = BUILD_TOOL.package_version(PACKAGES[name])
    return dist / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def run_checked(command: list[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; fail the test with its output if it exits non-zero."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
                    f"\n--- stderr ---\n{proc.stderr[-6000:]}", pytrace=False)
    return proc


@dataclass(frozen=True)
class Venv:
    """A fresh virtual environment and the commands the tests run in it."""

    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment its programs run with: this venv first on PATH, nothing of the outer one."""
        env = {k: v for k, v in os.environ.items() if k not in _OUTER_VARIABLES}
        env.update(VIRTUAL_ENV=str(self.root), PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}",
                   PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1",
                   DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1")
        env.update(extra)
        return env

    def pip(self, *args: str, timeout: float = PIP_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """`python -m pip ARGS` in the venv."""
        return run_checked([str(self.bin / "python"), "-m", "pip", *args], timeout=timeout, env=self.env())

    def install_from(self, dist: Path, requirement: str, report: Path) -> dict[str, Any]:
        """Install `requirement` from the local wheels only; returns pip's installation report.

        The command docs/index.md gives (`pip install --find-links dist 'lite-core[cuda]'`, torch
        installed first), with `--no-index` added so that a Lite package missing from dist/ fails
        here instead of coming from an index.
        """
        self.pip("install", "--no-index", "--find-links", str(dist), "--report", str(report), requirement)
        return json.loads(report.read_text())

    def python(self, code: str, *args: str, timeout: float = PYTHON_TIMEOUT) -> Any:
        """Run `code` in the venv's python (outside the source tree); returns the JSON it prints last."""
        proc = run_checked([str(self.bin / "python"), "-c", code, *args], timeout=timeout, env=self.env(),
                           cwd=self.root)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def script(self, path: Path, *args: str, timeout: float = PYTHON_TIMEOUT, **env: str) -> Any:
        """Run the program `path` in the venv's python (from its folder); returns the JSON it prints last."""
        proc = run_checked([str(self.bin / "python"), str(path), *args], timeout=timeout, env=self.env(**env),
                           cwd=path.parent)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def command(self, name: str, *args: str, timeout: float = PYTHON_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run a console script the venv installed (e.g. `lite`)."""
        return run_checked([str(self.bin / name), *args], timeout=timeout, env=self.env(), cwd=self.root)

    def distributions(self) -> dict[str, dict[str, Any]]:
        """Every installed distribution: canonical name -> version, location, direct_url.json."""
        return self.python(_DISTRIBUTIONS)


_DISTRIBUTIONS = """
import json
from importlib.metadata import distributions
from packaging.utils import canonicalize_name
found = {}
for dist in distributions():
    direct_url = dist.read_text("direct_url.json")
    found[canonicalize_name(dist.metadata["Name"])] = {
        "version": dist.version,
        "location": str(dist.locate_file("")),
        "direct_url": json.loads(direct_url) if direct_url else None,
    }
print(json.dumps(found))
"""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`package`: one test per workspace package; `backend`: one per package other than lite-core."""
    if "package" in metafunc.fixturenames:
        metafunc.parametrize("package", sorted(PACKAGES))
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", sorted(set(PACKAGES) - {"lite-core"}))


@pytest.fixture(scope="session")
def build_tool() -> ModuleType:
    """tools/build_all.py, loaded as a module."""
    return BUILD_TOOL


@pytest.fixture(scope="session")
def packages() -> dict[str, Path]:
    """Every workspace package's distribution name -> its directory."""
    return PACKAGES


@pytest.fixture(scope="session")
def wheel_of(dist: Path) -> Any:
    """`wheel_of(name)` -> the path of that package's freshly built wheel."""
    return lambda name: wheel_path(dist, name)


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the wheel and sdist of every package, built by `tools/build_all.py`."""
    out = tmp_path_factory.mktemp("dist")
    run_checked([sys.executable, str(ROOT / "tools" / "build_all.py"), "--out", str(out)], timeout=300)
    return out


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Venv:
    """A new venv (no system site-packages) holding only pip and the pinned torch; deleted when pytest ends."""
    root = tmp_path_factory.mktemp("venv")
    # About 1 GB, and pytest keeps its last three temp dirs. Deleted at pytest's exit, not in this
    # fixture's teardown: a session fixture's teardown runs inside the session's last test and counts
    # against that test's timeout (test_releases allows 30 s; the deletion took longer under CI's load).
    pytestconfig.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    venv_module.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(root)
    env = Venv(root)
    # Lite's own non-Lite requirements come from the index; every Lite package comes from dist.
    env.pip("install", TORCH, "packaging>=23", "numpy", "setuptools", "wheel")
    return env


@pytest.fixture(scope="session")
def core_alone(fresh_venv: Venv, dist: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`pip install lite-core` from the wheels: pip's report and the distributions installed after it."""
    report = fresh_venv.install_from(dist, "lite-core", tmp_path_factory.mktemp("reports") / "core.json")
    return {"report": report, "installed": fresh_venv.distributions()}


@pytest.fixture(scope="session")
def deepspeed_extra(core_alone: dict[str, Any], fresh_venv: Venv, dist: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepSpeed (the documented precondition), then `pip install 'lite-core[deepspeed]'` from the wheels."""
    # DeepSpeed's sdist imports torch while it builds: torch first, then no build isolation.
    fresh_venv.pip("install", "--no-build-isolation", DEEPSPEED)
    report = fresh_venv.install_from(dist, "lite-core[deepspeed]",
                                     tmp_path_factory.mktemp("reports") / "deepspeed.json")
    return {"report": report, "installed": fresh_venv.distributions()}


@pytest.fixture(scope="session")
def cuda_extra(core_alone: dict[str, Any], fresh_venv: Venv, dist: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`pip install 'lite-core[cuda]'` from the wheels (lite-cuda has no heavy dependency)."""
    report = fresh_venv.install_from(dist, "lite-core[cuda]", tmp_path_factory.mktemp("reports") / "cuda.json")
    return {"report": report, "installed": fresh_venv.distributions()}
