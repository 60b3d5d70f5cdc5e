"""The plugin interface: what backends may import, what the core knows of them, and strategies that
ask accelerators for capabilities instead of naming them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from lite_core import LightningLite, _registry, plugins
from lite_core.errors import BackendNotInstalledError, ConfigurationError

ROOT = Path(__file__).resolve().parents[3]
#: Every backend's source tree, and the test fake backend's: they may use public names only.
BACKEND_SOURCES = [*sorted((ROOT / "packages").glob("lite-*/src")), ROOT / "tests" / "fake_backend" / "src"]
BACKEND_SOURCES.remove(ROOT / "packages" / "lite-core" / "src")
_GROUPS = {"lite_core.accelerators": "accelerator", "lite_core.strategies": "strategy"}


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("LITE_FAKE_AVAILABLE", raising=False)
    _registry.clear_cache()
    yield
    _registry.clear_cache()
    sys.modules.pop("lite_fake_old", None)


# --- the public module ---------------------------------------------------------------------------

def test_every_name_of_the_plugin_interface_resolves() -> None:
    for name in plugins.__all__:
        assert getattr(plugins, name) is not None, name
    assert not [n for n in plugins.__all__ if n.startswith("_")]
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        plugins.Nothing  # noqa: B018


def test_importing_the_plugin_interface_imports_nothing_heavy() -> None:
    code = "import sys, lite_core.plugins; print(sorted(m for m in sys.modules if m.startswith(('lite_core.', 'torch'))))"
    fresh = {**os.environ, "LITE_TEST_FORKSERVER": "0"}  # an interpreter that has imported nothing yet
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=fresh).stdout
    assert "torch" not in loaded and "lite_core.strategies" not in loaded, loaded


def _private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """`lite_core` names that `path` reaches behind an underscore (module or name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules: list[str] = []
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lite_core":
            modules, names = [node.module], [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names if alias.name.split(".")[0] == "lite_core"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "lite_core":
            names = [node.attr]
        bad = [m for m in modules if any(part.startswith("_") for part in m.split("."))]
        bad += [n for n in names if n.startswith("_") and n != "__version__"]
        found += [f"{path.relative_to(root)}:{node.lineno}: {b}" for b in bad]  # type: ignore[attr-defined]
    return found


def test_backends_import_only_public_names_of_the_core() -> None:
    files = [f for source in BACKEND_SOURCES for f in sorted(source.rglob("*.py"))]
    assert len(files) > 20  # every backend was read
    assert [hit for f in files for hit in _private_imports(f)] == []


def test_the_import_check_sees_private_names(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from lite_core._checkpoint import to_state\nfrom lite_core.model.optimizer import _LiteOptimizerBase\n"
                      "import lite_core.launchers._processes\nimport lite_core\nlite_core._registry.clear_cache()\n")
    hits = [hit.split(": ", 1)[1] for hit in _private_imports(sample, root=tmp_path)]
    assert hits == ["lite_core._checkpoint", "_LiteOptimizerBase", "lite_core.launchers._processes", "_registry"]


# --- names the core knows of -----------------------------------------------------------------------

def _declared_entry_points() -> list[tuple[str, str, str]]:
    """(kind, name, distribution) for every entry point each backend's pyproject.toml declares."""
    declared = []
    for pyproject in sorted((ROOT / "packages").glob("lite-*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        if project["name"] == "lite-core":
            continue
        for group, kind in _GROUPS.items():
            declared += [(kind, name, project["name"]) for name in project.get("entry-points", {}).get(group, {})]
    return declared


def test_the_not_installed_table_matches_every_backend_entry_point() -> None:
    declared = _declared_entry_points()
    assert {dist for _, _, dist in declared} == {"lite-cuda", "lite-xla", "lite-deepspeed", "lite-torchft"}
    table = {(kind, name, _registry._EXTRA_PACKAGE[extra]) for kind, names in _registry._KNOWN_BACKENDS.items()
             for name, extra in names.items()}
    assert table == set(declared)


def test_the_known_backends_module_is_written_from_the_entry_points() -> None:
    """The core's table has one source per backend, its entry points: `_known_backends.py` is what
    tools/known_backends.py writes from them, not a second list kept by hand."""
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "known_backends.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert set(_registry.known_backends()) == {"lite-cuda", "lite-xla", "lite-deepspeed", "lite-torchft"}


def test_the_known_backends_check_sees_a_stale_module(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_known_backends_tool", ROOT / "tools" / "known_backends.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)  # type: ignore[union-attr]
    stale = tmp_path / "_known_backends.py"
    stale.write_text(tool.render().replace('"local_sgd",\n', ""), encoding="utf-8")  # a name dropped by hand
    tool.MODULE = stale
    assert tool.main(["--check"]) == 1
    assert tool.main([]) == 0 and stale.read_text(encoding="utf-8") == tool.render()


def test_single_xla_without_lite_xla_names_the_install_line() -> None:
    # this package's conftest hides installed real backends from the registry
    with pytest.raises(BackendNotInstalledError, match=r"lite-xla, which is not installed: run `pip install '\./packages/lite-core\[xla\]' \./packages/lite-xla`"):
        _registry.STRATEGIES.load("single_xla")


# --- capabilities instead of names ----------------------------------------------------------------------

def _accelerator(backend: str | None) -> Any:
    """An accelerator instance that declares `backend` as its process-group backend."""
    from lite_core.plugins import CPUAccelerator

    return type("DeclaredAccelerator", (CPUAccelerator,), {"name": "declared", "distributed_backend": backend})()


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "ddp_spawn"])
def test_the_fake_backends_device_runs_the_core_distributed_strategies(strategy: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_FAKE_AVAILABLE", "1")  # tests/fake_backend: an accelerator the core never names
    lite = LightningLite(accelerator="fake", strategy=strategy, devices=2)
    assert lite.strategy.accelerator.name == "fake"


def test_ddp_sharded_accepts_any_device_that_talks_gloo_or_nccl() -> None:
    from lite_core.strategies import DDPShardedStrategy  # fairscale itself is needed only to instantiate it

    assert DDPShardedStrategy.why_not_on(_accelerator("gloo")) is None
    assert DDPShardedStrategy.why_not_on(_accelerator("nccl")) is None
    assert DDPShardedStrategy.why_not_on(_accelerator("xccl")) == (
        "it works over the gloo or nccl process-group backend and this accelerator uses 'xccl': choose another"
        " strategy or accelerator")
    assert "process group, which this accelerator does not run" in DDPShardedStrategy.why_not_on(_accelerator(None))


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "ddp_fork"])
def test_a_device_without_a_process_group_is_refused_by_strategies_that_need_one(strategy: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        LightningLite(accelerator=_accelerator(None), strategy=strategy, devices=2)
    message = str(info.value)
    assert message.startswith(f"strategy={strategy!r} does not run on accelerator='declared': it needs a"
                              " torch.distributed process group")
    assert message.count(". ") == 0 and message.endswith(".")
    assert LightningLite(accelerator=_accelerator(None), strategy="single_device").strategy.name == "single_device"


def test_a_new_gpu_backend_with_its_own_process_group_backend_runs_fsdp() -> None:
    assert LightningLite(accelerator=_accelerator("xccl"), strategy="fsdp", devices=2).strategy.name == "fsdp"


def test_a_new_device_trains_under_fsdp_with_no_change_to_the_core(run_script: Any) -> None:
    proc = run_script("fake_device_fsdp.py", env={"LITE_FAKE_AVAILABLE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "OK fsdp on fake" in proc.stdout


def test_the_core_strategies_name_no_accelerator() -> None:
    from lite_core.strategies import DDPShardedStrategy, DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    for cls in (SingleDeviceStrategy, DDPStrategy, FSDPStrategy, DDPShardedStrategy):
        assert cls.supported_accelerators is None, cls
