"""Tests of the entry-point registry: lazy discovery, missing, misspelt, mismatched and broken backends.

The fake backend (`tests/fake_backend`, installed by the test environment) provides `fake`,
`fake_single` and `fake_broken`; other backends are written as distributions under `tmp_path`
and found by the real `importlib.metadata` discovery.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from importlib.metadata import distribution
from pathlib import Path

import pytest

from lite_core import _registry
from lite_core._registry import ACCELERATORS, STRATEGIES
from lite_core._suggest import closest
from lite_core.errors import (
    BackendImportError,
    BackendNotInstalledError,
    IncompatibleBackendError,
    UnknownNameError,
)
from lite_core.lite import LightningLite

_BUILTIN_STRATEGIES = {"single_device", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "ddp_sharded",
                       "ddp_sharded_spawn", "model_parallel"}
#: Modules of the backends that tests write under `tmp_path`.
_TMP_MODULES = ("lite_fake_old", "lite_fake_broken_accel")
_FAKE_MODULES = ("lite_fake_backend.accelerator", "lite_fake_backend.strategy", "lite_fake_backend.broken")


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Read the entry points anew and keep the fake accelerator unavailable unless a test says so."""
    monkeypatch.delenv("LITE_FAKE_AVAILABLE", raising=False)
    _registry.clear_cache()
    yield
    _registry.clear_cache()
    for module in _TMP_MODULES:
        sys.modules.pop(module, None)


@pytest.fixture
def unimported_fake_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget any fake-backend module another test imported (restored afterwards)."""
    for name in [n for n in sys.modules if n == "lite_fake_backend" or n.startswith("lite_fake_backend.")]:
        monkeypatch.delitem(sys.modules, name)


def install_backend(root: Path, monkeypatch: pytest.MonkeyPatch, name: str, *, requires: str | None,
                    entry_points: str, module_source: str) -> None:
    """Write an installed distribution `name` 0.0.1 with one module under `root` and put it on sys.path."""
    module = name.replace("-", "_")
    info = root / f"{module}-0.0.1.dist-info"
    info.mkdir()
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n"
    if requires is not None:
        metadata += f"Requires-Dist: {requires}\n"
    (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(entry_points)
    (root / f"{module}.py").write_text(module_source)
    monkeypatch.syspath_prepend(str(root))
    _registry.clear_cache()


_OLD_STRATEGY = (
    "from lite_core.strategies.single_device import SingleDeviceStrategy\n\n"
    "class OldStrategy(SingleDeviceStrategy):\n    name = 'fake_old'\n"
)


def install_fake_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requires: str | None) -> None:
    install_backend(tmp_path, monkeypatch, "lite-fake-old", requires=requires,
                    entry_points="[lite_core.strategies]\nfake_old = lite_fake_old:OldStrategy\n",
                    module_source=_OLD_STRATEGY)


def assert_one_sentence(message: str, *parts: str) -> None:
    """`message` is one sentence, and every one of `parts` is in it."""
    for part in parts:
        assert part in message
    assert "\n" not in message
    assert message.endswith(".")


# --- discovery ------------------------------------------------------------------------------------

def test_names_list_builtins_and_backends_without_importing_them(unimported_fake_backend: None) -> None:
    accelerators = ACCELERATORS.names()
    strategies = STRATEGIES.names()

    assert {"cpu", "fake"} <= set(accelerators)
    assert _BUILTIN_STRATEGIES | {"fake_single", "fake_broken"} <= set(strategies)
    assert accelerators == sorted(accelerators)
    for module in _FAKE_MODULES:
        assert module not in sys.modules


def test_loading_one_name_imports_only_its_module(unimported_fake_backend: None) -> None:
    accelerator_cls = ACCELERATORS.load("fake")

    assert accelerator_cls.__module__ == "lite_fake_backend.accelerator"
    assert accelerator_cls.name == "fake"
    assert "lite_fake_backend.accelerator" in sys.modules
    assert "lite_fake_backend.strategy" not in sys.modules
    assert "lite_fake_backend.broken" not in sys.modules


def test_builtins_are_registered_through_the_entry_point_groups() -> None:
    core = distribution("lite-core").entry_points
    assert set(core.select(group="lite_core.accelerators").names) == {"cpu"}
    assert set(core.select(group="lite_core.strategies").names) == _BUILTIN_STRATEGIES
    assert ACCELERATORS.load("cpu").__module__ == "lite_core.accelerators.cpu"
    assert STRATEGIES.load("ddp_spawn").__module__ == "lite_core.strategies.ddp"


def test_builtins_come_only_from_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    # No table of built-ins hides behind the registry: without entry points it knows nothing.
    monkeypatch.setattr(_registry, "entry_points", lambda group: [])
    _registry.clear_cache()

    assert STRATEGIES.names() == []
    with pytest.raises(UnknownNameError):
        STRATEGIES.load("ddp")


# --- known backends that are not installed ----------------------------------------------------------

@pytest.mark.parametrize(
    ("registry", "name", "package", "extra"),
    [
        (STRATEGIES, "deepspeed_stage_3", "lite-deepspeed", "deepspeed"),
        (STRATEGIES, "xla", "lite-xla", "xla"),
        (ACCELERATORS, "tpu", "lite-xla", "xla"),
        (ACCELERATORS, "cuda", "lite-cuda", "cuda"),
        (ACCELERATORS, "gpu", "lite-cuda", "cuda"),
    ],
)
def test_known_but_missing_backend_names_the_install_line(registry: _registry.Registry, name: str,
                                                           package: str, extra: str) -> None:
    with pytest.raises(BackendNotInstalledError) as info:
        registry.load(name)

    # the README's route from a clone: `pip install 'lite-core[EXTRA]'` fails while Lite is not on the index
    assert_one_sentence(str(info.value), f"pip install './packages/lite-core[{extra}]' ./packages/{package}", package)


@pytest.mark.parametrize(
    ("kwargs", "extra"),
    [({"strategy": "deepspeed_stage_3"}, "deepspeed"), ({"accelerator": "tpu"}, "xla"),
     ({"accelerator": "cuda"}, "cuda")],
)
def test_construction_with_a_missing_backend_names_the_install_line(kwargs: dict[str, str], extra: str) -> None:
    with pytest.raises(BackendNotInstalledError, match=rf"pip install '\./packages/lite-core\[{extra}\]' \./packages/lite-"):
        LightningLite(**kwargs)


# --- misspelt names ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("registry", "name", "guess"),
    [(STRATEGIES, "dpp", "ddp"), (STRATEGIES, "ddp_spwan", "ddp_spawn"), (ACCELERATORS, "cpuu", "cpu")],
)
def test_misspelt_name_suggests_the_closest_and_lists_valid_names(registry: _registry.Registry, name: str,
                                                                  guess: str) -> None:
    with pytest.raises(UnknownNameError) as info:
        registry.load(name)

    assert_one_sentence(str(info.value), f"did you mean {guess!r}?", f"valid names are {', '.join(registry.names())}.")


@pytest.mark.parametrize(
    ("name", "candidates", "guess"),
    [("dpp", ["dp", "ddp", "fsdp"], "ddp"), ("ddp", ["dp", "ddp_spawn"], "dp"), ("16-mixd", ["16-mixed", "16-true",
     "bf16-mixed"], "16-mixed"), ("xla_fdsp", ["xla", "xla_fsdp", "fsdp"], "xla_fsdp"), ("zzzz", ["ddp"], None)],
)
def test_the_guess_prefers_a_same_length_typo_among_near_matches(name: str, candidates: list[str],
                                                                 guess: str | None) -> None:
    assert closest(name, candidates) == guess


def test_unknown_name_without_a_close_match_still_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError) as info:
        STRATEGIES.load("zzzzzz")

    assert "did you mean" not in str(info.value)
    assert "valid names are ddp, " in str(info.value)


def test_misspelt_names_fail_at_construction() -> None:
    with pytest.raises(UnknownNameError, match="did you mean 'ddp'"):
        LightningLite(strategy="dpp")
    with pytest.raises(UnknownNameError, match="did you mean 'cpu'"):
        LightningLite(accelerator="cpuu")


# --- version compatibility ---------------------------------------------------------------------------------

def test_backend_needing_a_newer_core_is_refused_with_both_versions(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_old(tmp_path, monkeypatch, requires="lite-core>=9.0")

    assert "fake_old" in STRATEGIES.names()
    with pytest.raises(IncompatibleBackendError) as info:
        STRATEGIES.load("fake_old")

    assert_one_sentence(str(info.value), "lite-fake-old 0.0.1", "lite-core 0.1.0", ">=9.0",
                        "pip install --upgrade 'lite-core>=9.0'")
    assert "lite_fake_old" not in sys.modules  # refused before its module was imported


def test_backend_needing_an_older_core_says_to_upgrade_the_backend(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_old(tmp_path, monkeypatch, requires="lite-core<0.1")

    with pytest.raises(IncompatibleBackendError) as info:
        LightningLite(strategy="fake_old")

    assert_one_sentence(str(info.value), "lite-fake-old 0.0.1", "lite-core 0.1.0",
                        "pip install --upgrade lite-fake-old")


def test_requirement_spelt_with_another_name_form_is_still_checked(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_old(tmp_path, monkeypatch, requires="Lite_Core>=9.0")

    with pytest.raises(IncompatibleBackendError, match="lite-fake-old 0.0.1"):
        STRATEGIES.load("fake_old")


@pytest.mark.parametrize("requires", ["lite-core>=0.1,<0.2", 'lite-core>=9.0; extra == "dev"', None])
def test_compatible_backend_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requires: str | None) -> None:
    install_fake_old(tmp_path, monkeypatch, requires=requires)

    strategy_cls = STRATEGIES.load("fake_old")

    assert strategy_cls.__name__ == "OldStrategy"
    assert strategy_cls.__module__ == "lite_fake_old"


def test_a_backend_name_registered_with_capitals_is_found_in_any_case(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    install_backend(tmp_path, monkeypatch, "lite-fake-old", requires=None,
                    entry_points="[lite_core.strategies]\nFake_Old = lite_fake_old:OldStrategy\n",
                    module_source=_OLD_STRATEGY)

    assert "fake_old" in STRATEGIES.names()
    assert LightningLite(accelerator="cpu", strategy="FAKE_old").strategy.__class__.__name__ == "OldStrategy"


# --- version check of backend instances passed to LightningLite ------------------------------------

_OLD = "from lite_core.plugins import SingleDeviceStrategy\n\nclass OldStrategy(SingleDeviceStrategy):\n    name = 'fake_old'\n"


def test_a_strategy_instance_from_an_incompatible_backend_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    install_backend(tmp_path, monkeypatch, "lite-fake-old", requires="lite-core>=9.0",
                    entry_points="[lite_core.strategies]\nfake_old = lite_fake_old:OldStrategy\n", module_source=_OLD)
    old_strategy = importlib.import_module("lite_fake_old").OldStrategy

    class Mine(old_strategy):  # a user's subclass is the backend's too
        pass

    for instance in (old_strategy(), Mine()):
        with pytest.raises(IncompatibleBackendError, match=r"lite-fake-old 0.0.1 needs lite-core>=9.0"):
            LightningLite(accelerator="cpu", strategy=instance)


def test_an_accelerator_instance_from_an_incompatible_backend_is_refused(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    source = "from lite_core.plugins import CPUAccelerator\n\nclass OldCPU(CPUAccelerator):\n    name = 'old_cpu'\n"
    install_backend(tmp_path, monkeypatch, "lite-fake-old", requires="lite-core<0.1",
                    entry_points="[lite_core.accelerators]\nold_cpu = lite_fake_old:OldCPU\n", module_source=source)
    with pytest.raises(IncompatibleBackendError, match="pip install --upgrade lite-fake-old"):
        LightningLite(accelerator=importlib.import_module("lite_fake_old").OldCPU())


def test_a_compatible_backend_instance_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_backend(tmp_path, monkeypatch, "lite-fake-old", requires="lite-core>=0.1,<1",
                    entry_points="[lite_core.strategies]\nfake_old = lite_fake_old:OldStrategy\n", module_source=_OLD)
    lite = LightningLite(accelerator="cpu", strategy=importlib.import_module("lite_fake_old").OldStrategy())
    assert type(lite.strategy).__name__ == "OldStrategy"


# --- broken backends ------------------------------------------------------------------------------------

def test_broken_backend_names_the_strategy_and_distribution() -> None:
    with pytest.raises(BackendImportError) as info:
        STRATEGIES.load("fake_broken")

    assert_one_sentence(str(info.value), "'fake_broken'", "lite-fake-backend", "simulated broken backend")
    assert isinstance(info.value.__cause__, ImportError)
    assert str(info.value.__cause__) == "simulated broken backend"


def test_other_names_load_after_a_broken_one() -> None:
    with pytest.raises(BackendImportError):
        LightningLite(strategy="fake_broken")

    assert STRATEGIES.load("fake_single").name == "fake_single"
    lite = LightningLite(accelerator="cpu", strategy="ddp", devices=2)
    assert lite.strategy.name == "ddp"


def test_auto_accelerator_skips_a_broken_backend_with_a_warning(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    install_backend(tmp_path, monkeypatch, "lite-fake-broken-accel", requires="lite-core>=0.1",
                    entry_points="[lite_core.accelerators]\nbroken_accel = lite_fake_broken_accel:Accel\n",
                    module_source="raise ImportError('simulated broken accelerator')\n")
    assert "broken_accel" in ACCELERATORS.names()

    with pytest.warns(UserWarning, match="broken_accel.*simulated broken accelerator") as record:
        lite = LightningLite()
    assert record[0].filename == __file__  # the warning points at the user's line
    assert lite.strategy.accelerator is not None
    assert lite.strategy.accelerator.name == "cpu"

    # Named explicitly, the same backend fails loudly.
    with pytest.raises(BackendImportError, match="lite-fake-broken-accel"):
        LightningLite(accelerator="broken_accel")



def test_auto_accelerator_skips_an_incompatible_backend_with_a_warning(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    install_backend(tmp_path, monkeypatch, "lite-fake-future-accel", requires="lite-core>=9.0",
                    entry_points="[lite_core.accelerators]\nfuture_accel = lite_fake_future_accel:Accel\n",
                    module_source="raise AssertionError('must not be imported')\n")
    with pytest.warns(UserWarning, match="lite-fake-future-accel 0.0.1 needs lite-core>=9.0"):
        lite = LightningLite()
    assert lite.strategy.accelerator is not None and lite.strategy.accelerator.name == "cpu"
    with pytest.raises(IncompatibleBackendError):
        LightningLite(accelerator="future_accel")


def test_multi_line_import_error_is_reported_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_backend(tmp_path, monkeypatch, "lite-fake-chatty", requires=None,
                    entry_points="[lite_core.strategies]\nchatty = lite_fake_chatty:S\n",
                    module_source="raise ImportError('first line\\nsecond line\\nthird')\n")
    with pytest.raises(BackendImportError) as info:
        STRATEGIES.load("chatty")
    assert_one_sentence(str(info.value))
    assert "first line" in str(info.value) and "second line" not in str(info.value)
