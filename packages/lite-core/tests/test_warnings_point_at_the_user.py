"""Every warning Lite gives about the user's call points at the user's line (`_user_frame.warn_user`),
however many of Lite's frames (and `functools`/`contextlib` wrappers) lie between: the
constructor's environment and legacy warnings, a subclass's own `__init__`, `load`'s warnings
about a dataloader's position and an interrupted save, and a script run under `python`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from lite_core import LightningLite
from lite_core.connector._defaults import VARIABLES
from lite_core._user_frame import user_frame, warn_user


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)


def test_an_ignored_variable_points_at_the_line_that_constructs_lite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITE_PRECISION", "bf16-mixed")
    with pytest.warns(UserWarning, match="LITE_PRECISION='bf16-mixed' is ignored") as record:
        LightningLite(accelerator="cpu", precision="32-true")
    assert [w.filename for w in record] == [__file__]


def test_a_subclass_with_its_own_init_gets_the_warning_at_its_super_call(monkeypatch: pytest.MonkeyPatch) -> None:
    class Job(LightningLite):
        def __init__(self) -> None:
            super().__init__(accelerator="cpu", precision="32-true")  # the warned line

    monkeypatch.setenv("LITE_PRECISION", "bf16-mixed")
    with pytest.warns(UserWarning, match="is ignored") as record:
        Job()
    assert (record[0].filename, record[0].lineno) == (__file__, Job.__init__.__code__.co_firstlineno + 1)


def test_a_legacy_precision_points_at_the_users_line() -> None:
    with pytest.warns(FutureWarning, match="precision=64 is deprecated") as record:
        LightningLite(accelerator="cpu", precision=64)
    assert record[0].filename == __file__


class _Fixed(Sampler[int]):
    """A sampler with no state: Lite cannot draw its order again."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(10))

    def __len__(self) -> int:
        return 10


def _saved_two_batches_in(lite: LightningLite, loader: DataLoader, path: Path) -> None:
    iterator = iter(loader)
    next(iterator), next(iterator)
    lite.save({"loader": loader}, path)


def test_loading_a_loader_lite_cannot_resume_inside_points_at_the_load_call(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    # replace_sampler=False: the loader keeps its own sampler, which Lite cannot resume inside.
    _saved_two_batches_in(lite, lite.setup_dataloaders(DataLoader(range(10), batch_size=2), replace_sampler=False),
                          tmp_path / "c.pt")
    fresh = lite.setup_dataloaders(DataLoader(range(10), batch_size=2), replace_sampler=False)
    with pytest.warns(UserWarning, match="the epoch starts again from its first sample") as record:
        lite.load(tmp_path / "c.pt", {"loader": fresh})
    assert [w.filename for w in record] == [__file__]


def test_loading_a_sampler_lite_cannot_draw_again_points_at_the_load_call(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    loader = lite.setup_dataloaders(DataLoader(range(10), batch_size=2, sampler=_Fixed()))
    _saved_two_batches_in(lite, loader, tmp_path / "c.pt")
    fresh = lite.setup_dataloaders(DataLoader(range(10), batch_size=2, sampler=_Fixed()))
    with pytest.warns(UserWarning, match=r"sampler \(_Fixed\) has no set_epoch\(\)") as record:
        lite.load(tmp_path / "c.pt", {"loader": fresh})
    assert [w.filename for w in record] == [__file__]


def test_loading_the_checkpoint_an_interrupted_save_moved_aside_points_at_the_load_call(tmp_path: Path) -> None:
    lite = LightningLite(accelerator="cpu")
    aside = tmp_path / ".ckpt.pt.host-1.abc123.old"  # where a sharded save moves the previous checkpoint
    aside.mkdir()
    lite.save({"x": torch.ones(2)}, aside / "ckpt.pt")
    with pytest.warns(UserWarning, match="a save that was replacing it was interrupted") as record:
        content = lite.load(tmp_path / "ckpt.pt")
    assert torch.equal(content["x"], torch.ones(2))
    assert [w.filename for w in record] == [__file__]


def test_the_user_frame_skips_lites_frames_and_the_standard_wrappers() -> None:
    import contextlib
    import functools

    @functools.lru_cache(maxsize=None)
    def cached() -> str:
        return user_frame().f_code.co_filename  # type: ignore[union-attr]

    assert cached() == __file__  # this test's own function is the user's frame
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with contextlib.nullcontext():
            warn_user("from the user's frame", RuntimeWarning)
    assert [(w.filename, w.category) for w in record] == [(__file__, RuntimeWarning)]


@pytest.mark.timeout(120)  # a hang guard: the script imports torch and builds two LightningLite objects (~5 s)
def test_a_script_under_python_sees_each_warning_at_its_own_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from lite_core import LightningLite

        lite = LightningLite(accelerator="cpu", devices=1)  # line 4: LITE_DEVICES=2 is ignored
        legacy = LightningLite(accelerator="cpu", devices=2, precision="bf16")  # line 5: the legacy name
        """))
    env = {**os.environ, "LITE_DEVICES": "2", "PYTHONWARNINGS": "default"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "Warning: " in line]
    assert [line.split(": ")[0] for line in warned] == [f"{script}:4", f"{script}:5"], result.stderr
