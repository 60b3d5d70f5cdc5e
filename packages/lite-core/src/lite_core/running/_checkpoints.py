"""Checkpoints as `LightningLite` saves and loads them: in the foreground or in the background
(one save in flight at a time, its failure raised on every rank at the next call), and the
previous checkpoint read where a sharded save was interrupted while replacing it."""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

from lite_core._user_frame import warn_user
from lite_core.checkpoint import CheckpointIO
from lite_core.precision.precision import Precision
from lite_core.checkpoint._background import BackgroundSaves
from lite_core.checkpoint.stores import as_local, store_for
from lite_core.errors import CheckpointError, ConfigurationError, MissingDependencyError
from lite_core.running._collectives import require_processes
from lite_core.strategies.strategy import Strategy
from lite_core._install import install_hint


class Checkpoints:
    """`save`, `load` and `wait_for_checkpoint` through one strategy, with the job's checkpoint IO
    and precision (whose state a checkpoint holds), which this room holds and hands to the
    strategy's `save_checkpoint`, `stage_checkpoint` and `load_checkpoint`."""

    def __init__(self, strategy: Strategy, checkpoint_io: CheckpointIO, precision: Precision) -> None:
        self._strategy = strategy
        self._checkpoint_io = checkpoint_io
        self._precision = precision
        self._background = BackgroundSaves()
        #: Seconds the loop spent inside `save` (a blocking write, or a background save's copy to
        #: host memory and its wait for the save before it) and the saves so far: what
        #: `ThroughputMonitor` reports as the checkpoints' stall.
        self.stalled_seconds = 0.0
        self.saves = 0

    def save(self, content: dict[str, Any], filepath: str | os.PathLike[str], blocking: bool) -> None:
        started = time.perf_counter()
        try:
            self._save(content, filepath, blocking)
        finally:
            self.stalled_seconds += time.perf_counter() - started
        self.saves += 1

    def _save(self, content: dict[str, Any], filepath: str | os.PathLike[str], blocking: bool) -> None:
        require_processes(self._strategy, "save")
        self.wait()
        path = self._checked(filepath)
        # A rank may still be reading the checkpoint at `path` (a load just before, as a resumed
        # loop does): no rank writes over it until every rank is here.
        self._strategy.barrier("save")
        reason = None if blocking else self._strategy.why_no_background_save()
        if blocking or reason is not None:
            if reason is not None:
                warn_user(f"save(blocking=False) writes '{path}' before it returns under"
                          f" strategy={self._strategy.name!r}: {reason}.")
            self._strategy.save_checkpoint(path, content, checkpoint_io=self._checkpoint_io,
                                           precision=self._precision)
            return
        self._background.start(path, lambda: self._strategy.stage_checkpoint(
            path, content, checkpoint_io=self._checkpoint_io, precision=self._precision))

    def _checked(self, filepath: str | os.PathLike[str]) -> str:
        """`filepath` as a str (`file://` URLs as local paths), refused before any write or read if it
        is a URL this strategy cannot use or whose fsspec back end is missing."""
        path = as_local(os.fspath(filepath))
        store_for(path).check(path, self._strategy)
        return path

    def wait(self) -> None:
        self._background.wait(self._strategy)

    def load_safetensors(self, module: Any, folder: str | os.PathLike[str]) -> None:
        """Each process reads its part of the safetensors files in the local `folder` into `module`."""
        from lite_core.checkpoint._hf_load import read_safetensors
        from lite_core.model.parts import forward_module

        require_processes(self._strategy, "load_safetensors")
        _require_safetensors("load_safetensors")
        path = os.fspath(folder)
        if not store_for(path).local:
            raise CheckpointError(f"load_safetensors reads a local folder, not '{path}': download the files first"
                                  " (huggingface_hub's snapshot_download, or the store's fsspec `get`) on every node.")
        if not type(self._strategy).loads_safetensors:
            raise CheckpointError(
                f"strategy={self._strategy.name!r} holds its modules' weights its own way, so load_safetensors"
                " cannot read into them: load the model with transformers' from_pretrained before setup()."
            )
        self.wait()
        read_safetensors(forward_module(module), path)

    def export_safetensors(self, module: Any, folder: str | os.PathLike[str], max_file_bytes: int,
                           holder: tuple[Any, str] | None = None) -> None:
        """The set-up model's whole state gathered to rank 0, which writes it as safetensors; with
        `holder`, `(set-up model, prefix)`, `module` is the part of that model under `prefix`
        (what peft's `merge_and_unload()` returns): its weights under their names in it."""
        from lite_core.checkpoint import on_rank_zero
        from lite_core.checkpoint._export import export, tied_names

        require_processes(self._strategy, "export_safetensors")
        _require_safetensors("export_safetensors")
        if max_file_bytes <= 0:
            raise ConfigurationError(f"max_file_bytes={max_file_bytes} is not a size: pass a positive number of bytes.")
        path = as_local(os.fspath(folder))
        store_for(path).check(path)  # every strategy can export to a URL: rank 0 writes the whole state
        self.wait()
        tied = tied_names(module)
        if holder is None:
            state = self._strategy.full_module_state_dict(module)
        else:
            state = _under(self._strategy.full_module_state_dict(holder[0]), holder[1])
        on_rank_zero(self._strategy, path, lambda: export(state, path, max_file_bytes, tied))

    def abandon(self) -> None:
        """Forget the save in flight (the run failed): its thread finishes on its own."""
        self._background.abandon()

    def load(self, filepath: str | os.PathLike[str], state: dict[str, Any] | None, strict: bool,
             weights_only: bool, missing_ok: bool) -> dict[str, Any]:
        self.wait()
        path = self._checked(filepath)
        store = store_for(path)
        # An unfinished upload is refused, not taken for "missing"; on a local disk, the previous
        # checkpoint that a save interrupted between its renames left aside is read.
        path = store.to_read(path)
        if missing_ok and not store.exists(path):
            return {}
        return self._strategy.load_checkpoint(path, state, strict=strict, weights_only=weights_only,
                                              checkpoint_io=self._checkpoint_io, precision=self._precision)


def _under(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of `state` under `prefix` (`"base_model.model."`), named without it."""
    return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}


def _require_safetensors(call: str) -> None:
    if importlib.util.find_spec("safetensors") is None:
        raise MissingDependencyError(f"{call} needs the safetensors package, which is not installed:"
                                     f" run `{install_hint('hf')}`.")
