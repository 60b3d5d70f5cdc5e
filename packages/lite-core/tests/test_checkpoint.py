"""save() is atomic and load() is safe by default, with one-sentence errors for bad files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import CheckpointError


def _lite() -> LightningLite:
    return LightningLite(accelerator="cpu")


def test_save_and_load_restore_modules_optimizers_and_values(tmp_path: Path) -> None:
    lite = _lite()
    model = nn.Linear(3, 2)
    model, optimizer = lite.setup(model, torch.optim.Adam(model.parameters()))
    lite.backward(model(torch.ones(1, 3)).sum())
    optimizer.step()
    lite.save({"model": model, "optimizer": optimizer, "step": 7}, tmp_path / "ckpt.pt")

    other = _lite()
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    content = other.load(tmp_path / "ckpt.pt", state)
    assert state["step"] == 7 and content["step"] == 7
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == 1


def test_saved_model_keys_are_the_users(tmp_path: Path) -> None:
    lite = _lite()
    model = lite.setup(nn.Sequential(nn.Linear(2, 2)))
    lite.save({"model": model}, tmp_path / "ckpt.pt")
    assert list(torch.load(tmp_path / "ckpt.pt")["model"]) == ["0.weight", "0.bias"]


def test_strict_load_names_missing_entries(tmp_path: Path) -> None:
    lite = _lite()
    lite.save({"a": 1}, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match=r"no entry for \['b'\].*strict=False"):
        lite.load(tmp_path / "ckpt.pt", {"a": 0, "b": 0})
    state = {"a": 0, "b": 5}
    lite.load(tmp_path / "ckpt.pt", state, strict=False)
    assert state == {"a": 1, "b": 5}


def test_weights_of_another_model_are_one_sentence_and_strict_false_loads_what_fits(tmp_path: Path) -> None:
    lite = _lite()
    lite.save({"model": lite.setup(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))}, tmp_path / "ckpt.pt")
    other = lite.setup(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)))
    with pytest.raises(CheckpointError, match=r"^The checkpoint's weights do not fit this Sequential: 4 keys differ \(2"
                                              r" missing from the checkpoint: '2.weight', '2.bias'; 2 unexpected:"
                                              r" '1.weight', '1.bias'\): load it into the model it was saved from, or"
                                              r" pass strict=False to load only the keys that match\.$"):
        lite.load(tmp_path / "ckpt.pt", {"model": other})
    lite.load(tmp_path / "ckpt.pt", {"model": other}, strict=False)
    assert torch.equal(other[0].weight, torch.load(tmp_path / "ckpt.pt")["model"]["0.weight"])


#: What `load` says of a model 2 wide given a checkpoint of one 3 wide, under every strategy.
_OTHER_SHAPES = (r"The checkpoint's weights do not fit this Sequential: 2 weights have another shape in the"
                 r" checkpoint \('0\.weight': \(3, 2\) saved, \(2, 2\) here; '0\.bias': \(3,\) saved, \(2,\)"
                 r" here\): load it into a model built like the one it was saved from \(strict=False passes"
                 r" over missing and unexpected keys, not weights of another shape\)\.")


class _Widths(LightningLite):
    """Saves a model `width` wide to `path`, or loads `path` into one."""

    def run(self, path: Path, width: int, load: bool = False, strict: bool = True) -> None:
        model = self.setup_module(nn.Sequential(nn.Linear(2, width)))
        if load:
            self.load(path, {"model": model}, strict=strict)
        else:
            self.save({"model": model}, path)


@pytest.mark.timeout(180)
def test_weights_of_another_shape_are_a_mismatch_of_the_model_under_every_strategy(tmp_path: Path) -> None:
    # Under fsdp the sharded load said the checkpoint was not complete; elsewhere torch's raw lists.
    from lite_core.strategies import FSDPStrategy

    savers = {"one file": lambda: "ddp", "fsdp sharded": lambda: "fsdp",
              "fsdp full": lambda: FSDPStrategy(state_dict_type="full")}
    for kind, strategy in savers.items():
        _Widths(accelerator="cpu", strategy=strategy(), devices=1).run(tmp_path / kind, 3)
        for loader in ("ddp", "fsdp"):
            for strict in (True, False):  # strict=False cannot help: no load fills a weight of another shape
                with pytest.raises(CheckpointError, match=f"^{_OTHER_SHAPES}$"):
                    _Widths(accelerator="cpu", strategy=loader, devices=1).run(tmp_path / kind, 2, load=True,
                                                                               strict=strict)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="No checkpoint file at .*check the path"):
        _lite().load(tmp_path / "nope.pt")


def test_missing_ok_resumes_nothing_when_there_is_no_checkpoint_yet(tmp_path: Path) -> None:
    lite = _lite()
    state = {"epoch": 0, "model": nn.Linear(2, 2)}
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    assert lite.load(tmp_path / "nope.pt", state, missing_ok=True) == {}
    assert state["epoch"] == 0
    assert all(torch.equal(v, before[k]) for k, v in state["model"].state_dict().items())
    lite.save({"epoch": 3, "model": nn.Linear(2, 2)}, tmp_path / "ckpt.pt")  # once it exists, it is loaded
    assert lite.load(tmp_path / "ckpt.pt", state, missing_ok=True)["epoch"] == 3
    assert state["epoch"] == 3


def test_a_directory_of_another_format_is_refused_in_one_sentence(tmp_path: Path) -> None:
    # e.g. a DeepSpeed checkpoint directory given to a strategy that reads Lite's own formats
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("global_step3")
    with pytest.raises(CheckpointError) as info:
        _lite().load(tmp_path / "ckpt")
    message = str(info.value)
    assert message.startswith(f"'{tmp_path / 'ckpt'}' is a directory but not a sharded checkpoint")
    assert "load it under the strategy that saved it" in message
    assert "\n" not in message and message.endswith(".")


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    _lite().save({"weights": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or is not a checkpoint"):
        _lite().load(path)


def test_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("these are not tensors")
    with pytest.raises(CheckpointError, match="truncated or is not a checkpoint"):
        _lite().load(path)


class Arbitrary:
    """A class a checkpoint might pickle; safe loading must refuse it."""


def test_pickled_code_is_refused_by_default_and_allowed_on_request(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"obj": Arbitrary()}, path)
    with pytest.raises(CheckpointError, match="weights_only=False"):
        _lite().load(path)
    assert isinstance(_lite().load(path, weights_only=False)["obj"], Arbitrary)


def test_save_leaves_no_temporary_files(tmp_path: Path) -> None:
    _lite().save({"x": torch.ones(1)}, tmp_path / "sub" / "ckpt.pt")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["ckpt.pt"]


def test_save_starts_the_disk_write_while_serialising_and_flushes_the_file_before_renaming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large save hands each written 8 MiB stretch to the kernel's writeback as it goes (so
    the final fsync waits for little), covers the whole file that way, and fsyncs it before the
    rename makes it the checkpoint."""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("os.posix_fadvise does not exist on this platform: saves pass writes through unchanged")
    events: list[tuple[str, int, int]] = []
    real_advise, real_fsync, real_replace = os.posix_fadvise, os.fsync, os.replace

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        events.append(("advise", offset, length))
        real_advise(fd, offset, length, advice)

    def fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_size, 0))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", 0, 0))
        real_replace(src, dst)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    weights = torch.arange(10 * 2**20, dtype=torch.float32)  # 40 MiB
    _lite().save({"weights": weights}, tmp_path / "ckpt.pt")
    monkeypatch.undo()

    size = (tmp_path / "ckpt.pt").stat().st_size
    advised = [(offset, length) for kind, offset, length in events if kind == "advise"]
    assert len(advised) >= 4, events
    assert all(length >= 8 << 20 for _, length in advised)
    assert [offset for offset, _ in advised] == [0] + [sum(length for _, length in advised[:i]) for i in range(1, len(advised))]
    assert size - sum(length for _, length in advised) < 8 << 20  # the rest is left to fsync
    kinds = [kind for kind, *_ in events]
    assert kinds.index("replace") > kinds.index("fsync") > max(i for i, kind in enumerate(kinds) if kind == "advise")
    assert [size for kind, size, _ in events if kind == "fsync"][0] == size
    assert torch.equal(_lite().load(tmp_path / "ckpt.pt")["weights"], weights)


def test_save_removes_what_interrupted_saves_of_the_same_path_left_behind(tmp_path: Path) -> None:
    import socket

    host = socket.gethostname().replace(".", "_")
    dead_pid = 2**22 + 1  # above Linux's largest pid: no such process
    now, old = time.time(), time.time() - 3600
    leftovers = {  # name -> whether the next save removes it
        f".ckpt.pt.{host}-{dead_pid}.abc_1234.tmp": True,  # its writer on this host is gone
        f".ckpt.pt.{host}-{os.getppid()}.abc_1234.tmp": False,  # a live writer on this host
        ".ckpt.pt.otherhost-12.abc_1234.tmp": True,  # another host's, untouched since long ago
        ".ckpt.pt.busyhost-12.abc_1234.tmp": False,  # another host's, still being written
        ".ckpt.pt.abc_1234.tmp": True,  # an older version's, untouched since long ago
        f".ckpt.pt.bak.{host}-{dead_pid}.abc_1234.tmp": False,  # another file's
        f".other.pt.{host}-{dead_pid}.abc_1234.tmp": False,
    }
    for name in leftovers:
        (tmp_path / name).write_bytes(b"partial")
        written = now + 60 if "busyhost" in name else old
        os.utime(tmp_path / name, (written, written))
    # The path was saved under fsdp before: an interrupted sharded save's staging folder and the
    # folder a save moved the previous checkpoint into are this path's leftovers too.
    for name, removed in {f".ckpt.pt.{host}-{dead_pid}.abcd_123.tmp": True, f".ckpt.pt.{host}-{dead_pid}.abcd_123.old": True,
                          f".ckpt.pt.{host}-{os.getppid()}.abcd_123.old": False}.items():
        (tmp_path / name / "ckpt.pt").mkdir(parents=True)
        leftovers[name] = removed
    _lite().save({"x": 1}, tmp_path / "ckpt.pt")
    kept = {p.name for p in tmp_path.iterdir()}
    assert kept == {"ckpt.pt", *(name for name, removed in leftovers.items() if not removed)}


class _ShardedSave(LightningLite):
    def run(self, path: Path) -> None:
        model = self.setup_module(nn.Linear(2, 2))
        self.save({"model": model}, path)


@pytest.mark.timeout(120)
def test_a_sharded_save_removes_the_staging_folders_interrupted_saves_left(tmp_path: Path) -> None:
    import socket

    host = socket.gethostname().replace(".", "_")
    dead_pid = 2**22 + 1  # above Linux's largest pid: no such process
    old = time.time() - 3600
    leftovers = {  # staging folder -> whether the next sharded save of `ckpt` removes it
        f".ckpt.{host}-{dead_pid}.abc_1234.tmp": True,  # rank 0 of that save is gone
        f".ckpt.{host}-{os.getppid()}.abc_1234.tmp": False,  # a live writer on this host
        ".ckpt.otherhost-12.abc_1234.tmp": True,  # another host's, untouched since long ago
        ".ckpt.busyhost-12.abc_1234.tmp": False,  # another host's, a shard still being written
        f".other.{host}-{dead_pid}.abc_1234.tmp": False,  # another checkpoint's
    }
    for name in leftovers:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"partial")
        os.utime(folder, (old, old))
        written = time.time() + 60 if "busyhost" in name else old
        os.utime(folder / "__0_0.distcp", (written, written))
    (tmp_path / f".ckpt.{host}-{dead_pid}.abc_1234.tmp.file").write_bytes(b"x")  # not a staging name
    _ShardedSave(accelerator="cpu", strategy="fsdp", devices=1).run(tmp_path / "ckpt")
    remaining = {p.name for p in tmp_path.iterdir()}
    expected = {name for name, removed in leftovers.items() if not removed}
    assert remaining == {"ckpt", f".ckpt.{host}-{dead_pid}.abc_1234.tmp.file", *expected}


class _Versioned(LightningLite):
    """Saves (or loads) a sharded checkpoint whose model weights and `version` are `version`."""

    def run(self, path: Path, version: int, load: bool = False) -> dict:
        model = self.setup_module(nn.Linear(2, 2, bias=False))
        state = {"model": model, "version": 0}
        if load:
            self.load(path, state, missing_ok=True)
            return {"version": state["version"], "weight": model.weight.full_tensor().tolist()}
        nn.init.constant_(model.weight.to_local(), float(version))
        self.save({"model": model, "version": version}, path)
        return {}


def _dies_between_the_renames(path: Path, call: str) -> int:
    """The exit code of a process that runs `call` (this module's names, `PATH` for `path`) and is
    killed right after a save moved the checkpoint at `path` aside, before the new one is in place."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint import _Resume, _Versioned
        real_replace = os.replace
        def dying_replace(source, destination):
            real_replace(source, destination)
            if os.fspath(source) == {str(path)!r}:  # the old checkpoint is aside, the new one not in place
                os._exit(9)
        os.replace = dying_replace
        PATH = Path({str(path)!r})
        """
    ) + call
    return subprocess.run([sys.executable, "-c", script], timeout=100).returncode


@pytest.mark.timeout(120)
def test_a_sharded_save_that_died_between_its_renames_leaves_the_previous_checkpoint_to_load(tmp_path: Path) -> None:
    # A folder cannot replace another in one rename: the old checkpoint is moved aside first. A
    # process killed right then left nothing at the path, and a restarted job began from scratch.
    path = tmp_path / "ckpt"
    _Versioned(accelerator="cpu", strategy="fsdp", devices=1).run(path, 1)
    assert _dies_between_the_renames(path, '_Versioned(accelerator="cpu", strategy="fsdp", devices=1).run(PATH, 2)') == 9
    assert not path.exists()
    with pytest.warns(UserWarning, match="a save that was replacing it was interrupted"):
        loaded = _Versioned(accelerator="cpu", strategy="fsdp", devices=1).run(path, 0, load=True)
    assert loaded == {"version": 1, "weight": [[1.0, 1.0], [1.0, 1.0]]}
    _Versioned(accelerator="cpu", strategy="fsdp", devices=1).run(path, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the aside folder and the staging one are gone


class _Resume(LightningLite):
    """The checkpoint calls of the preemption page's loop: resume from `path` if it holds a
    checkpoint, take a step, save to `path`; returns the step."""

    def run(self, path: Path | str) -> int:
        model = self.setup_module(nn.Linear(2, 2))
        state = {"model": model, "step": 0}
        self.load(path, state, missing_ok=True)
        state["step"] += 1
        self.save(state, path)
        return state["step"]


@pytest.mark.timeout(180)
def test_a_checkpoint_path_keeps_working_when_the_strategy_changes(tmp_path: Path) -> None:
    # A sharded checkpoint (a folder) resumed under ddp, which writes one file: the next save
    # failed with IsADirectoryError; and back under fsdp, the folder replaces the file.
    from lite_core.strategies import FSDPStrategy

    path = tmp_path / "last"
    strategies = [lambda: "fsdp", lambda: "ddp", lambda: "ddp", lambda: "fsdp", lambda: "fsdp",
                  lambda: FSDPStrategy(state_dict_type="full"), lambda: "fsdp"]
    steps = [_Resume(accelerator="cpu", strategy=strategy(), devices=1).run(path) for strategy in strategies]
    assert steps == [1, 2, 3, 4, 5, 6, 7]
    assert path.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["last"]  # nothing of the replaced layouts is left


@pytest.mark.timeout(120)
def test_a_one_file_save_that_died_replacing_a_sharded_checkpoint_leaves_it_to_load(tmp_path: Path) -> None:
    path = tmp_path / "last"
    assert _Resume(accelerator="cpu", strategy="fsdp", devices=1).run(path) == 1
    assert _dies_between_the_renames(path, '_Resume(accelerator="cpu", strategy="ddp", devices=1).run(PATH)') == 9
    assert not path.exists()
    with pytest.warns(UserWarning, match="a save that was replacing it was interrupted"):
        assert _Resume(accelerator="cpu", strategy="ddp", devices=1).run(path) == 2  # resumed from step 1
    assert path.is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["last"]  # the aside folder and the temporary file are gone


class _SavesTo(LightningLite):
    def run(self, *paths: Path) -> None:
        model = self.setup_module(nn.Linear(2, 2))
        for path in paths:
            self.save({"model": model}, path)


@pytest.mark.timeout(120)
def test_a_sharded_save_to_a_file_name_says_once_that_it_writes_a_folder(tmp_path: Path) -> None:
    import warnings

    from lite_core.strategies import FSDPStrategy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning Lite gives, not Python's once per line
        _SavesTo(accelerator="cpu", strategy="fsdp", devices=1).run(tmp_path / "final.pt", tmp_path / "final.pt",
                                                                     tmp_path / "best.ckpt", tmp_path / "step-3")
        _SavesTo(accelerator="cpu", strategy=FSDPStrategy(state_dict_type="full"), devices=1).run(tmp_path / "one.pt")
    said = [str(w.message) for w in caught if "folder" in str(w.message)]
    assert said == [f"save() writes '{tmp_path / 'final.pt'}' as a folder of shards, not one file, under"
                    " strategy='fsdp': pass FSDPStrategy(state_dict_type='full') to write one file, or save to"
                    " a name without a file suffix to keep the shards."]
    assert (tmp_path / "final.pt").is_dir() and (tmp_path / "one.pt").is_file()


@pytest.mark.timeout(60)
def test_kill_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    _lite().save({"version": 1}, path)
    script = textwrap.dedent(
        f"""
        import os, torch
        from lite_core import LightningLite
        real_save = torch.save
        def dying_save(obj, f, *args, **kwargs):
            f.write(b"partial bytes")
            f.flush()
            os._exit(9)
        torch.save = dying_save
        LightningLite(accelerator="cpu").save({{"version": 2}}, {str(path)!r})
        """
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=50)
    assert result.returncode == 9
    assert _lite().load(path) == {"version": 1}


class Counter:
    """A user object with state: saved through its state_dict(), never pickled itself."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _training_objects(lite: LightningLite) -> dict:
    """What a user keeps in a checkpoint: schedulers built on the raw optimizer before setup and
    on the set-up one after it, a gradient scaler and an object of their own."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    raw = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1)
    before = torch.optim.lr_scheduler.StepLR(raw, step_size=2, gamma=0.5)
    model, optimizer = lite.setup(model, raw)
    after = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.9 ** epoch)
    return {"model": model, "optimizer": optimizer, "before": before, "after": after,
            "scaler": torch.amp.GradScaler("cpu", init_scale=64.0), "counter": Counter()}


def test_schedulers_scalers_and_user_objects_round_trip_with_weights_only(tmp_path: Path) -> None:
    lite = _lite()
    state = _training_objects(lite)
    for _ in range(3):
        lite.backward(state["model"](torch.ones(1, 3)).sum())
        state["optimizer"].step()
        state["before"].step()
        state["after"].step()
        state["counter"].seen += 1
    state["scaler"].scale(torch.ones(1))
    state["scaler"].update(16.0)
    lite.save(state, tmp_path / "ckpt.pt")
    saved_lrs = [group["lr"] for group in state["optimizer"].param_groups]

    fresh = _training_objects(_lite())
    content = _lite().load(tmp_path / "ckpt.pt", fresh)  # weights_only by default
    for key in ("before", "after", "scaler", "counter"):
        assert fresh[key].state_dict() == state[key].state_dict(), key
        assert isinstance(content[key], dict), key  # the state, not the object, was saved
    assert fresh["before"].last_epoch == 3 and fresh["counter"].seen == 3
    assert fresh["scaler"].get_scale() == 16.0
    assert [group["lr"] for group in fresh["optimizer"].param_groups] == saved_lrs
    fresh["after"].step()  # the restored scheduler keeps driving the restored optimizer
    assert fresh["optimizer"].param_groups[1]["lr"] != saved_lrs[1]


def test_failed_save_raises_one_checkpoint_error_caused_by_the_original(tmp_path: Path) -> None:
    (tmp_path / "ckpt.pt").mkdir()  # a directory in the way
    with pytest.raises(CheckpointError) as info:
        _lite().save({"x": torch.ones(1)}, tmp_path / "ckpt.pt")
    message = str(info.value)
    assert "\n" not in message and message.endswith(".") and not re.search(r"[.!?]\s+[A-Z][a-z]", message), message
    assert "failed on rank 0 with IsADirectoryError" in str(info.value)
    assert isinstance(info.value.__cause__, IsADirectoryError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary file left
