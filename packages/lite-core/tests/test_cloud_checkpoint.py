"""Checkpoints at fsspec URLs in one process: `memory://` and `s3://` (moto's S3 server on
127.0.0.1, the `s3_bucket` fixture) hold what a local path holds, blocking and in the background;
a URL is never turned into a local folder; a URL is refused before anything is written where its
back end is missing or the strategy writes local files only; an upload that failed midway leaves
the previous checkpoint loadable and is refused by `load` in one sentence; `weights_only` stays the
default; `latest(prefix)` finds the checkpoint committed last.

The multi-process cases (ddp, fsdp, a server stopped mid-upload, store errors on every rank) are
in `tests/integration/test_cloud_checkpoints.py`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from conftest import linear_adam, squared_step  # the repository's conftest.py
from lite_core import LightningLite
from lite_core.checkpoint import latest
from lite_core.errors import CheckpointError, MissingDependencyError
from lite_core.strategies.single_device import SingleDeviceStrategy


def _one_sentence(message: str) -> None:
    assert message.endswith(".") and ". " not in message, message


def _test_checkpoint_module() -> Any:
    spec = importlib.util.spec_from_file_location("_test_checkpoint", Path(__file__).with_name("test_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


#: The preemption page's resume, step and save (test_checkpoint.py's), here at a URL.
_Resume = _test_checkpoint_module()._Resume


def _memory_base() -> str:
    return f"memory://runs/{uuid.uuid4().hex[:8]}"


def _setup() -> tuple[LightningLite, Any, Any]:
    torch.manual_seed(0)
    return linear_adam(0.1)


_step = squared_step


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


# -- a URL is a URL ---------------------------------------------------------------------------
def test_an_s3_url_without_s3fs_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # how Python marks a package unimportable
    # and fsspec forgets the class it registered if an earlier test in this process used s3fs
    registered = importlib.import_module("fsspec.registry")._registry
    for protocol in ("s3", "s3a"):
        monkeypatch.delitem(registered, protocol, raising=False)
    lite, model, _ = _setup()
    for call in (lambda: lite.save({"model": model}, "s3://bucket/run1/ckpt"),
                 lambda: lite.save({"model": model}, "s3://bucket/run1/ckpt", blocking=False),
                 lambda: lite.load("s3://bucket/run1/ckpt")):
        with pytest.raises(MissingDependencyError, match=r"pip install 's3fs>=2023\.1'") as info:
            call()
        _one_sentence(str(info.value))
    assert list(tmp_path.iterdir()) == []  # no ./s3:/bucket/run1/ckpt


def test_a_url_that_pathlib_flattened_is_refused_not_written_as_a_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    lite, model, _ = _setup()
    with pytest.raises(CheckpointError, match="pass the URL as a str") as info:
        lite.save({"model": model}, Path("s3://bucket/ckpt"))
    _one_sentence(str(info.value))
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_protocol_is_refused_in_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    lite, model, _ = _setup()
    with pytest.raises(CheckpointError, match="fsspec knows no protocol 'nosuchstore://'") as info:
        lite.save({"model": model}, "nosuchstore://bucket/ckpt")
    _one_sentence(str(info.value))
    assert list(tmp_path.iterdir()) == []


class LocalFilesOnly(SingleDeviceStrategy):
    """A strategy whose engine writes only local files, as DeepSpeed's and torch-xla's do."""

    checkpoint_urls = False


def test_a_strategy_that_writes_local_files_only_refuses_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    lite = LightningLite(accelerator="cpu", strategy=LocalFilesOnly())
    model = lite.setup(nn.Linear(3, 2))
    url = f"{_memory_base()}/ckpt"
    for call in (lambda: lite.save({"model": model}, url), lambda: lite.load(url)):
        with pytest.raises(CheckpointError, match="on the local file system only") as info:
            call()
        _one_sentence(str(info.value))
    assert not fsspec.filesystem("memory").exists(url)
    lite.save({"model": model}, tmp_path / "ckpt.pt")  # a local path still works
    assert (tmp_path / "ckpt.pt").is_file()


def test_a_file_url_is_written_the_local_atomic_way(tmp_path: Path) -> None:
    lite, model, _ = _setup()
    lite.save({"model": model, "step": 4}, f"file://{tmp_path}/ckpt.pt")
    assert torch.load(tmp_path / "ckpt.pt")["step"] == 4
    assert lite.load(f"file://{tmp_path}/ckpt.pt")["step"] == 4


def test_a_local_name_with_colons_stays_a_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    lite, model, _ = _setup()
    lite.save({"model": model, "step": 7}, "ckpt::v2")  # `NAME::` chains fsspec protocols only for a known NAME
    assert torch.load(tmp_path / "ckpt::v2")["step"] == 7


# -- the same content at a URL as at a local path ----------------------------------------------
@pytest.mark.parametrize("store", ["memory", "s3"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_url_holds_what_a_local_path_holds(request: pytest.FixtureRequest, tmp_path: Path, store: str,
                                             blocking: bool) -> None:
    base = request.getfixturevalue("s3_bucket") + "/run" if store == "s3" else _memory_base()
    lite, model, optimizer = _setup()
    _step(lite, model, optimizer)
    content = {"model": model, "optimizer": optimizer, "step": 1, "history": [0.5]}
    lite.save(content, tmp_path / "ckpt.pt", blocking=blocking)
    lite.save(content, f"{base}/ckpt.pt", blocking=blocking)
    _step(lite, model, optimizer)  # changes the live state: the checkpoints hold the call's
    lite.wait_for_checkpoint()

    local = lite.load(tmp_path / "ckpt.pt")
    remote = lite.load(f"{base}/ckpt.pt")
    assert _same(remote, local)
    fresh_lite, fresh_model, fresh_optimizer = _setup()
    fresh_lite.load(f"{base}/ckpt.pt", {"model": fresh_model, "optimizer": fresh_optimizer})
    assert _same(fresh_model.state_dict(), local["model"])
    assert _same(fresh_optimizer.state_dict(), local["optimizer"])
    assert latest(base) == f"{base}/ckpt.pt"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("store", ["memory", "s3"])
def test_a_url_keeps_working_when_the_strategy_changes(request: pytest.FixtureRequest, store: str) -> None:
    # A one-file save to a URL that held a sharded checkpoint landed inside its folder, and the
    # old shards kept being loaded.
    base = request.getfixturevalue("s3_bucket") + "/run" if store == "s3" else _memory_base()
    steps = [_Resume(accelerator="cpu", strategy=strategy, devices=1).run(f"{base}/last")
             for strategy in ("fsdp", "ddp", "ddp", "fsdp", "ddp")]
    assert steps == [1, 2, 3, 4, 5]
    fs, key = fsspec.core.url_to_fs(base)
    fs.invalidate_cache()
    assert fs.isfile(f"{key}/last") and not fs.isdir(f"{key}/last")
    assert [path.rstrip("/").rpartition("/")[2] for path in fs.ls(key, detail=False)] == ["last"]
    assert latest(base) == f"{base}/last"


def test_missing_ok_at_a_url_returns_nothing_for_an_empty_prefix() -> None:
    lite, model, _ = _setup()
    assert lite.load(f"{_memory_base()}/ckpt", {"model": model}, missing_ok=True) == {}


# -- complete or absent -----------------------------------------------------------------------
class _FailingWrites:
    """Makes the fsspec write of every file whose path contains "step-2" fail after its first
    bytes, as a store that goes away in the middle of an upload would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, on_failure: Any = None) -> None:
        from fsspec.implementations.memory import MemoryFile
        from fsspec.spec import AbstractBufferedFile

        self.failures = 0
        self._on_failure = on_failure
        for cls in (MemoryFile, AbstractBufferedFile):
            monkeypatch.setattr(cls, "write", self._wrap(cls.write))

    def _wrap(self, write: Any) -> Any:
        def failing_write(handle: Any, data: Any) -> int:
            written = write(handle, data)
            if "step-2" in str(getattr(handle, "path", "")):
                self.failures += 1
                if self._on_failure is not None:
                    self._on_failure()
                raise ConnectionResetError(104, "Connection reset by peer")
            return written

        return failing_write


@pytest.mark.parametrize("store", ["memory", "s3"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_an_upload_that_fails_midway_keeps_the_previous_checkpoint_and_is_refused(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, store: str, blocking: bool) -> None:
    base = request.getfixturevalue("s3_bucket") + "/run" if store == "s3" else _memory_base()
    lite, model, optimizer = _setup()
    lite.save({"model": model, "step": 1}, f"{base}/step-1")
    lite.save({"model": model, "step": 1}, f"{base}/step-2")  # the checkpoint the failed save replaces
    _step(lite, model, optimizer)
    faults = _FailingWrites(monkeypatch)
    with pytest.raises(CheckpointError, match=r"step-2' failed on rank 0 with ConnectionResetError") as info:
        lite.save({"model": model, "step": 2}, f"{base}/step-2", blocking=blocking)
        lite.wait_for_checkpoint()
    _one_sentence(str(info.value))
    assert faults.failures
    monkeypatch.undo()

    assert lite.load(f"{base}/step-2")["step"] == 1  # a one-file checkpoint stays until the new one is whole
    fs, key = fsspec.core.url_to_fs(base)
    fs.rm(f"{key}/step-2")  # now as if the failed save had been its first
    with pytest.raises(CheckpointError, match="never finished") as info:
        lite.load(f"{base}/step-2")
    _one_sentence(str(info.value))
    assert lite.load(f"{base}/step-1")["step"] == 1
    assert latest(base) == f"{base}/step-1"


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_the_next_save_of_a_name_removes_the_temporary_key_an_interrupted_upload_left(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, store: str) -> None:
    base = request.getfixturevalue("s3_bucket") + "/run" if store == "s3" else _memory_base()
    fs, key = fsspec.core.url_to_fs(base)
    lite, model, _ = _setup()
    # The store goes away between the upload and the copy: the save fails and cannot delete its key.
    monkeypatch.setattr(fs, "mv", _gone)  # fsspec hands every caller of the URL this instance
    monkeypatch.setattr(fs, "rm_file", _gone)
    for name in ("step-1", "step-2"):
        with pytest.raises(CheckpointError, match="failed on rank 0 with ConnectionResetError"):
            lite.save({"model": model}, f"{base}/{name}")
    monkeypatch.undo()
    fs.invalidate_cache()
    left = {name: _temporaries(fs, key, name) for name in ("step-1", "step-2")}
    assert all(len(keys) == 1 for keys in left.values()), left
    planted = fs.modified(left["step-2"][0]).timestamp()
    while time.time() < int(planted) + 1:  # S3 keeps whole seconds: the next save starts in a later one
        time.sleep(0.05)
    # A key of the name written while the save runs (another saver's upload in flight) is kept.
    begin = sys.modules["lite_core.checkpoint._store"].begin

    def begin_beside_another_upload(url: str) -> None:
        begin(url)
        fs.pipe_file(f"{key}/.step-2.otherhost-7.0123abcd.tmp", b"in flight")

    monkeypatch.setattr("lite_core.checkpoint._store.begin", begin_beside_another_upload)
    lite.save({"model": model}, f"{base}/step-2")
    fs.invalidate_cache()
    assert _temporaries(fs, key, "step-2") == [f"{key}/.step-2.otherhost-7.0123abcd.tmp"]
    assert _temporaries(fs, key, "step-1") == left["step-1"]  # another name's leftover is not this save's
    assert latest(base) == f"{base}/step-2"


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_a_save_removes_what_a_dead_process_of_this_host_left_of_another_name(
        request: pytest.FixtureRequest, store: str) -> None:
    """A job that saves `step-N` never saves an interrupted name again: its leftovers (the
    temporary key and the pending marker of a process killed mid-upload) go at the next save of
    any name once their writer is known dead; another host's are kept (found by the chaos soak)."""
    from lite_core.checkpoint._store import writer

    base = request.getfixturevalue("s3_bucket") + "/run" if store == "s3" else _memory_base()
    fs, key = fsspec.core.url_to_fs(base)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    host = writer().rsplit("-", 1)[0]
    fs.pipe_file(f"{key}/.step-1.{host}-{dead}.0123abcd.tmp", b"killed mid-upload")
    fs.pipe_file(f"{key}/.step-1.lite-pending", b"")
    fs.pipe_file(f"{key}/.step-3.otherhost-7.0123abcd.tmp", b"another host's, maybe in flight")
    # A store gone mid-upload before the temporary key existed leaves only the marker (the chaos job's store-down).
    fs.pipe_file(f"{key}/.step-4.lite-pending", f"{host}-{dead}".encode())
    fs.pipe_file(f"{key}/.step-5.lite-pending", b"otherhost-7")
    lite, model, _ = _setup()
    lite.save({"model": model}, f"{base}/step-2")
    fs.invalidate_cache()
    names = sorted(path.rstrip("/").rpartition("/")[2] for path in fs.ls(key, detail=False))
    assert names == [".step-3.otherhost-7.0123abcd.tmp", ".step-5.lite-pending", "step-2"], names


def _gone(*args: Any, **kwargs: Any) -> None:
    raise ConnectionResetError("the store went away")


def _temporaries(fs: Any, key: str, name: str) -> list[str]:
    return sorted(path.rstrip("/") for path in fs.ls(key, detail=False)
                  if path.rstrip("/").rpartition("/")[2].startswith(f".{name}.") and path.endswith(".tmp"))


def test_missing_ok_does_not_take_an_unfinished_upload_for_a_fresh_start(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _memory_base()
    lite, model, _ = _setup()
    _FailingWrites(monkeypatch)
    with pytest.raises(CheckpointError):
        lite.save({"model": model}, f"{base}/step-2")
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="never finished"):
        lite.load(f"{base}/step-2", {"model": model}, missing_ok=True)


def test_an_unfinished_sharded_upload_is_refused_under_a_strategy_that_writes_one_file() -> None:
    base = _memory_base()
    fs, key = fsspec.core.url_to_fs(base)
    _touch_sharded(fs, f"{key}/step-1", complete=False)  # shards, no `.metadata`
    lite, model, _ = _setup()
    for missing_ok in (False, True):
        with pytest.raises(CheckpointError, match="never finished") as info:
            lite.load(f"{base}/step-1", {"model": model}, missing_ok=missing_ok)
        _one_sentence(str(info.value))


def test_a_server_stopped_during_an_upload_fails_the_save_and_the_next_load_says_it_never_finished(
        s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsspec.spec import AbstractBufferedFile

    base = f"{s3_bucket}/run"
    lite, model, _ = _setup()
    lite.save({"model": model, "step": 1}, f"{base}/step-1")
    write = AbstractBufferedFile.write

    def stop_then_write(handle: Any, data: Any) -> int:
        if "step-2" in handle.path:
            s3_server.stop()
        return write(handle, data)

    monkeypatch.setattr(AbstractBufferedFile, "write", stop_then_write)
    with pytest.raises(CheckpointError, match=r"step-2' failed on rank 0 with EndpointConnectionError") as info:
        lite.save({"model": model, "step": 2}, f"{base}/step-2")
    _one_sentence(str(info.value))
    assert "check the store's endpoint" in str(info.value)
    monkeypatch.undo()
    s3_server.start()
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(CheckpointError, match=r"The upload of the checkpoint '.*step-2' never finished"):
        lite.load(f"{base}/step-2")
    assert lite.load(f"{base}/step-1")["step"] == 1
    assert latest(base) == f"{base}/step-1"


# -- safe loading -----------------------------------------------------------------------------
class Note:
    """A Python object that only full unpickling restores."""

    def __init__(self, text: str) -> None:
        self.text = text


def test_loading_from_a_url_is_weights_only_by_default() -> None:
    lite, model, _ = _setup()
    url = f"{_memory_base()}/ckpt"
    lite.save({"model": model, "note": Note("hello")}, url)
    with pytest.raises(CheckpointError, match=r"call load\(\.\.\., weights_only=False\)") as info:
        lite.load(url)
    _one_sentence(str(info.value))
    assert lite.load(url, weights_only=False)["note"].text == "hello"


# -- finding the latest -----------------------------------------------------------------------
def _touch_sharded(fs: Any, folder: str, complete: bool) -> None:
    fs.makedirs(folder, exist_ok=True)
    fs.pipe_file(f"{folder}/__0_0.distcp", b"shard")
    if complete:
        fs.pipe_file(f"{folder}/.metadata", b"metadata")


@pytest.mark.parametrize("where", ["memory", "local"])
def test_latest_is_the_complete_checkpoint_committed_last(tmp_path: Path, where: str) -> None:
    base = _memory_base() if where == "memory" else str(tmp_path / "run")
    fs, key = fsspec.core.url_to_fs(base)
    fs.makedirs(key, exist_ok=True)
    assert latest(base) is None
    lite, model, _ = _setup()
    lite.save({"model": model}, os.path.join(base, "step-9") if where == "local" else f"{base}/step-9")
    time.sleep(0.01)  # a later commit time (the file systems here keep sub-second times)
    _touch_sharded(fs, f"{key}/step-10", complete=True)
    time.sleep(0.01)
    _touch_sharded(fs, f"{key}/step-11", complete=False)  # an unfinished upload
    fs.pipe_file(f"{key}/metrics.csv", b"step,loss\n")  # not a checkpoint
    fs.pipe_file(f"{key}/.step-12.host-1.abcd.tmp", b"PK\x03\x04")  # a temporary file
    expected = f"{base}/step-10" if where == "memory" else os.path.join(base, "step-10")
    assert latest(base) == expected
    assert latest(f"{base}/nothing-here") is None


def test_latest_breaks_ties_in_natural_name_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import datetime, timezone

    from fsspec.implementations.memory import MemoryFileSystem

    base = _memory_base()
    fs, key = fsspec.core.url_to_fs(base)
    for name in ("step-9", "step-10", "step-2"):
        _touch_sharded(fs, f"{key}/{name}", complete=True)
    same_second = datetime(2026, 1, 1, tzinfo=timezone.utc)  # S3 keeps whole seconds
    monkeypatch.setattr(MemoryFileSystem, "modified", lambda self, path: same_second)
    assert latest(base) == f"{base}/step-10"
