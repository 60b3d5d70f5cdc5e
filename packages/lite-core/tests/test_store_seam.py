"""A checkpoint store added by this module alone: `ToyStore`, registered for `toy://` with
`lite_core.plugins.register_store`, keeps checkpoints in a folder (`TOY_STORE_ROOT`) under a commit
rule of its own (a `.NAME.toy-partial` file or folder renamed into place, each commit recorded in
the folder's `journal`). A user's `save`, `load` and `latest` round trip goes through it in one
process and in 2-process `ddp` and `fsdp` jobs (this file, run as a script); if any checkpoint code
bypassed the store, a save would fail (fsspec knows no `toy://`), land in a relative `toy:` folder
of the working directory, or leave the journal without its commit.

    python test_store_seam.py STRATEGY ROOT     (what the 2-process tests run)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import CheckpointError, ConfigurationError
from lite_core.plugins import FsspecStore, LocalStore, Store, register_store, store_for

T = TypeVar("T")
_PREFIX = "toy://"


class ToyStore(Store):
    """`toy://KEY` is the file or folder `$TOY_STORE_ROOT/KEY`; a checkpoint is written beside
    its name as `.NAME.toy-partial` and renamed into place, and the commit appended to `journal`."""

    def __init__(self) -> None:
        self.root = Path(os.environ["TOY_STORE_ROOT"])

    def real(self, path: str) -> Path:
        if not path.startswith(_PREFIX):
            raise AssertionError(f"the toy store was handed '{path}', which is not one of its paths")
        return self.root / path[len(_PREFIX):]

    def partial(self, path: str) -> str:
        parent, _, name = path.rstrip("/").rpartition("/")
        return f"{parent}/.{name}.toy-partial"

    def commit(self, partial: str, path: str, kind: str) -> None:
        source, target = self.real(partial), self.real(path)
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(source, target)
        with open(self.root / "journal", "a") as journal:
            journal.write(f"{kind} {path}\n")

    def join(self, path: str, name: str) -> str:
        return f"{path.rstrip('/')}/{name}"

    def exists(self, path: str) -> bool:
        return self.real(path).exists()

    def is_file(self, path: str) -> bool:
        return self.real(path).is_file()

    def filesystem(self, path: str) -> tuple[Any, str]:
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(), str(self.real(path))

    def save_file(self, checkpoint: dict[str, Any], path: str) -> None:
        partial = self.partial(path)
        self.real(partial).parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, self.real(partial))
        self.commit(partial, path, "file")

    def save_part(self, checkpoint: dict[str, Any], path: str) -> None:
        torch.save(checkpoint, self.real(path))  # inside a partial folder, committed as a whole

    def load_file(self, path: str, weights_only: bool) -> dict[str, Any]:
        if not self.real(path).is_file():
            raise self.missing(path)
        return torch.load(self.real(path), map_location="cpu", weights_only=weights_only)

    def shard_writer(self, folder: str) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(str(self.real(folder)))

    def shard_reader(self, path: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(str(self.real(path)))

    def start_sharded(self, path: str, extra: dict[str, Any], io: Any) -> str:
        partial = self.partial(path)
        shutil.rmtree(self.real(partial), ignore_errors=True)
        self.real(partial).mkdir(parents=True)
        return partial

    def commit_sharded(self, folder: str, path: str, extra: dict[str, Any], io: Any, started: float) -> None:
        io.save_part(extra, self.join(folder, "lite_extra.pt"))
        self.commit(folder, path, "sharded")

    def write_folder(self, path: str, write: Callable[[str], T], last: str) -> T:
        return write(str(self.real(path)))

    def missing(self, path: str) -> CheckpointError:
        return CheckpointError(f"The toy store holds nothing at '{path}': save there first.")


register_store("toy", ToyStore)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class RoundTrip(LightningLite):
    """Two steps, a blocking save to `toy://run/step-1`, a step, a background save to
    `toy://run/step-2`; then a fresh model loads `latest("toy://run")` and must equal the saved one."""

    def run(self) -> dict[str, Any]:
        from lite_core.checkpoint import latest

        model, optimizer = self.build()
        for seed in range(2):
            self.step(model, optimizer, seed)
        self.save({"model": model, "optimizer": optimizer, "step": 1}, "toy://run/step-1")
        self.step(model, optimizer, 2)
        saved = {name: value.clone() for name, value in self.full_state_dict(model).items()}
        self.save({"model": model, "optimizer": optimizer, "step": 2}, "toy://run/step-2", blocking=False)
        self.wait_for_checkpoint()

        found = latest("toy://run")
        fresh, fresh_optimizer = self.build()
        content = self.load(found, {"model": fresh, "optimizer": fresh_optimizer})
        loaded = self.full_state_dict(fresh)
        same = all(torch.equal(saved[name], loaded[name]) for name in saved)
        with pytest.raises(CheckpointError, match="The toy store holds nothing at 'toy://run/step-9'"):
            self.load("toy://run/step-9", {"model": fresh})
        return {"latest": found, "step": content["step"], "same": same,
                "missing_ok": self.load("toy://run/step-9", {"model": fresh}, missing_ok=True)}

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = make_model()
        return self.setup(model, torch.optim.Adam(model.parameters(), lr=0.05))

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed * 10 + self.global_rank))
        optimizer.zero_grad()
        self.backward(model(x).pow(2).mean())
        optimizer.step()


def _check_the_store_was_used(root: Path, workdir: Path, kind: str) -> None:
    journal = (root / "journal").read_text().splitlines()
    assert journal == [f"{kind} toy://run/step-1", f"{kind} toy://run/step-2"], journal
    assert not list(workdir.glob("toy*")), "a save bypassed the store and wrote a local 'toy:' folder"
    assert not [entry.name for entry in (root / "run").iterdir() if entry.name.startswith(".")]


@pytest.fixture
def toy_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    monkeypatch.setenv("TOY_STORE_ROOT", str(root))
    monkeypatch.chdir(tmp_path)
    return root


def test_each_path_gets_its_store_once_by_its_protocol(toy_root: Path) -> None:
    assert isinstance(store_for("toy://run/step-1"), ToyStore)
    assert isinstance(store_for("s3://bucket/run"), FsspecStore)
    assert isinstance(store_for("simplecache::s3://bucket/run"), FsspecStore)
    assert isinstance(store_for(str(toy_root)), LocalStore)
    assert isinstance(store_for(Path("toy://flattened")), LocalStore)  # a Path is never a URL
    # What lite_torchft asks: whether every node sees the same checkpoint at the path.
    assert store_for("s3://bucket/run").shared and not store_for(str(toy_root)).shared


def test_a_protocol_that_is_not_one_is_refused_in_one_sentence() -> None:
    with pytest.raises(ConfigurationError, match=r"register_store got protocol='toy://'.*pass its name without"):
        register_store("toy://", ToyStore)


def test_a_round_trip_in_one_process_goes_through_the_registered_store(toy_root: Path, tmp_path: Path) -> None:
    result = RoundTrip(accelerator="cpu", devices=1).run()
    assert result == {"latest": "toy://run/step-2", "step": 2, "same": True, "missing_ok": {}}
    _check_the_store_was_used(toy_root, tmp_path, "file")


def test_a_strategy_that_writes_local_files_only_refuses_a_registered_store(toy_root: Path) -> None:
    lite = LightningLite(accelerator="cpu", devices=1)
    type(lite.strategy).checkpoint_urls, before = False, type(lite.strategy).checkpoint_urls
    try:
        with pytest.raises(CheckpointError, match="writes and reads checkpoints on the local file system only"):
            lite.save({"step": 1}, "toy://run/step-1")
    finally:
        type(lite.strategy).checkpoint_urls = before
    assert not (toy_root / "run").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("strategy", "kind"), [("ddp", "file"), ("fsdp", "sharded")])
def test_a_round_trip_in_a_2_process_job_goes_through_the_registered_store(
        run_script, output_of, tmp_path: Path, strategy: str, kind: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    proc = run_script(command=[sys.executable, __file__, strategy, str(root)], env={"TOY_STORE_ROOT": str(root)})
    assert proc.returncode == 0, output_of(proc)
    for rank in (0, 1):
        assert f"rank {rank}: latest toy://run/step-2 step 2 same True missing_ok {{}}" in proc.stdout, output_of(proc)
    _check_the_store_was_used(root, Path(__file__).resolve().parents[3] / "tests" / "scripts", kind)


if __name__ == "__main__":
    torch.set_num_threads(1)
    job = RoundTrip(accelerator="cpu", strategy=sys.argv[1], devices=2)
    outcome = job.run()
    print(f"rank {job.global_rank}: latest {outcome['latest']} step {outcome['step']} same {outcome['same']}"
          f" missing_ok {outcome['missing_ok']}", flush=True)
