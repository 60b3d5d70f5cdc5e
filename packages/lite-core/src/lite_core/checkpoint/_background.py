"""Checkpoints written in the background: `save(..., blocking=False)`.

The save stages the state in host memory before it returns (`stage_to_host`, or torch distributed
checkpoint's own stager for sharded saves), so that the optimizer steps that follow cannot leak
into it; a writer thread then finishes the write. There is at most one save in flight: the next
save, `load`, `wait_for_checkpoint()` and the end of `run()` wait for it, and every rank learns
there whether it failed anywhere (as `on_writing_ranks` tells a blocking save's failure).
"""

from __future__ import annotations

import atexit
import copy
import sys
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from lite_core.checkpoint._rank_zero import on_writing_ranks

if TYPE_CHECKING:
    from lite_core._roles import Ranks

#: What a strategy's `stage_checkpoint` returns: the rest of the save, run in the writer thread.
Write = Callable[[], None]


def stage_to_host(state: Any) -> Any:
    """A copy of `state` whose tensors live in host memory and share nothing with the originals.

    Tensors already on the CPU are copied too (a state dict's tensors *are* the live parameters
    and optimizer buffers); a tensor that appears twice (tied weights) is copied once and stays
    shared. Other values are deep-copied, so a list the loop appends to later does not change.
    """
    memo: dict[int, Any] = {}
    for leaf in tree_leaves(state):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
            memo[id(leaf)] = _host_copy(leaf)
    return copy.deepcopy(state, memo)


class _Staging:
    """The host buffers one background save stages into: taken from its `BackgroundSaves`' spare
    buffers (those of the previous save, whose write was waited for) where a (shape, dtype) matches,
    so that the host memory of one staged copy of the state stays with the process between
    background saves instead of being allocated (and page-faulted in) anew; given back when this
    save's write is done."""

    def __init__(self, spare: dict[tuple[Any, ...], list[torch.Tensor]]) -> None:
        self.spare = spare
        self.buffers: list[torch.Tensor] = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        reusable = self.spare.get((tuple(tensor.shape), tensor.dtype))
        buffer = reusable.pop().copy_(tensor.detach()) if reusable else tensor.detach().to("cpu", copy=True)
        self.buffers.append(buffer)
        return buffer


#: The staging of the background save whose `stage_checkpoint` runs now (`BackgroundSaves.start`
#: sets it around that call only); `None` elsewhere, where `stage_to_host` copies afresh.
_STAGING: ContextVar[_Staging | None] = ContextVar("lite_checkpoint_staging", default=None)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
    staging = _STAGING.get()
    if staging is None or not (plain and tensor.is_contiguous()):
        return tensor.detach().to("cpu", copy=True)  # subclasses, sparse and strided views: a fresh copy
    return staging.copy(tensor)


def checkpoint_process_group() -> Any:
    """A gloo process group over every rank for torch distributed checkpoint's writer thread:
    its collectives must not interleave with the training loop's on the default group (and
    `async_save` needs a CPU backend). Made once per default group, by every rank at the same
    save (as `new_group` requires)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if _GROUPS.get("world") is not world:
        _GROUPS.update(world=world, group=dist.new_group(backend="gloo"))
    return _GROUPS["group"]


#: The default process group `checkpoint_process_group` was made for, and that group.
_GROUPS: dict[str, Any] = {}


def nothing() -> None:
    """The write of a rank that has nothing to write (one-file saves write on rank 0 only)."""


class _Pending:
    """One save in flight: its writer thread, the host buffers it staged, and what the write raised."""

    def __init__(self, path: str, write: Write, buffers: list[torch.Tensor]) -> None:
        self.path = path
        self.error: Exception | None = None
        self.buffers = buffers
        self._write = write
        # Not a daemon: the interpreter waits for it at exit, so the file is finished.
        self.thread = threading.Thread(target=self._run, name=f"lite-checkpoint-writer:{path}")

    def _run(self) -> None:
        try:
            self._write()
        except Exception as err:  # told to every rank by `BackgroundSaves.wait`
            self.error = err

    def reraise(self) -> None:
        if self.error is not None:
            raise self.error


class BackgroundSaves:
    """The background save of one `LightningLite` (at most one in flight) and its outcome."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None
        self._exit_hook = False
        #: The host buffers of the last save whose write was waited for, by (shape, dtype).
        self._spare: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def __reduce__(self) -> tuple[type[BackgroundSaves], tuple[()]]:
        return BackgroundSaves, ()  # a spawned process starts with no save in flight

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._pending is not None

    def start(self, path: str, stage: Callable[[], Write]) -> None:
        """Stage the save (`stage`: the strategy's `stage_checkpoint`, whose `stage_to_host` copies
        into this object's spare buffers) and run the write it returns in a writer thread; call
        `wait` first if a save is in flight."""
        assert self._pending is None, "wait for the save in flight first"
        staging = _Staging(self._spare)
        token = _STAGING.set(staging)
        try:
            write = stage()
        finally:
            _STAGING.reset(token)
        self._pending = _Pending(path, write, staging.buffers)
        self._pending.thread.start()
        if not self._exit_hook:
            atexit.register(self._finish_at_exit)
            self._exit_hook = True

    def wait(self, strategy: Ranks) -> None:
        """Wait for the save in flight; if its write failed on any rank, raise a `CheckpointError`
        on every rank. Every rank must call this (a collective when a save is in flight)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.thread.join()
        self._release(pending.buffers)
        on_writing_ranks(strategy, pending.path, pending.reraise, writes=True)

    def _release(self, buffers: list[torch.Tensor]) -> None:
        """Keep a finished save's buffers for the next save to stage into."""
        for buffer in buffers:
            self._spare.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)

    def abandon(self) -> None:
        """After this rank failed: wait for the local write only (no collective, as other ranks
        may be gone), and report a failed write on stderr rather than hide it."""
        self._finish_at_exit()

    def _finish_at_exit(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.thread.join()
        self._release(pending.buffers)
        if pending.error is not None:
            print(f"lite: the background save of '{pending.path}' failed with {pending.error!r}; the previous"
                  " checkpoint at that path is kept.", file=sys.stderr)
