"""Writing a checkpoint with every rank told whether it worked, so that a failed save stops
every rank at `save` instead of leaving the others to fail later, elsewhere, or to wait."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypeVar

import torch

from lite_core.checkpoint.stores import store_for
from lite_core.errors import CheckpointError

if TYPE_CHECKING:
    from lite_core._roles import Ranks

T = TypeVar("T")


def on_rank_zero(strategy: Ranks, path: str, action: Callable[[], T]) -> T:
    """`action()` on rank 0 only, its result broadcast to every rank.

    If `action` raises on rank 0, every rank raises a `CheckpointError` naming that error (on
    rank 0 the original error is its cause). Every rank must call this, as it is a collective.
    """
    result, error = _attempt(action) if strategy.global_rank == 0 else (None, None)
    failure, result = strategy.broadcast((None if error is None else _describe(error), result))
    if failure is not None:
        _raise_for(path, 0, failure, error)
    return result


def on_writing_ranks(strategy: Ranks, path: str, action: Callable[[], object], writes: bool) -> None:
    """`action()` on every rank where `writes` is true (each writes its own part, or each host
    its own copy), then every rank learns whether it failed anywhere.

    If `action` raises on any rank, every rank raises a `CheckpointError` naming the first rank
    that failed and its error (on that rank the original error is its cause). Every rank must
    call this, as it is a collective; it also serves as the barrier after the write.
    """
    error = _attempt(action)[1] if writes else None
    # Moved as a batch is: a backend may need its own way (XLA bakes a moved scalar into the graph).
    flags = strategy.all_gather(strategy.batch_to_device(torch.tensor(int(error is not None))))
    failed = [rank for rank, flag in enumerate(flags.flatten().tolist()) if flag]
    if not failed:
        return
    first = failed[0]
    failure = strategy.broadcast(_describe(error) if error is not None and strategy.global_rank == first else None, src=first)
    _raise_for(path, first, failure, error)


def _attempt(action: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """`(action(), None)`, or `(None, the error)` if it raised one; an error is told to every rank
    by the caller, while KeyboardInterrupt and the like stop this process as they are."""
    try:
        return action(), None
    except Exception as err:
        return None, err


def shard_failure(path: str, error: BaseException) -> CheckpointError:
    """A `CheckpointError` for torch distributed checkpoint's `CheckpointException` (which every
    rank of a sharded save gets): the first rank that failed and its error (as its cause)."""
    rank, cause = first_failure(error)
    failure = _error_for(path, rank, _describe(cause), cause)
    failure.__cause__ = cause
    return failure


def first_failure(error: BaseException) -> tuple[int, BaseException]:
    """The first rank that failed in torch distributed checkpoint's `CheckpointException`, and its error."""
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return 0, error
    rank = min(failures)
    cause = failures[rank]
    if isinstance(cause, tuple):  # (the error, its traceback)
        cause = cause[0]
    return rank, cause if isinstance(cause, BaseException) else RuntimeError(str(cause))


def _raise_for(path: str, rank: int, failure: str, error: Exception | None) -> None:
    raise _error_for(path, rank, failure, error) from error


def _error_for(path: str, rank: int, failure: str, error: BaseException | None) -> CheckpointError:
    fix = store_for(path).save_failure_fix(failure)  # from the text every rank has, so that every rank says the same
    return CheckpointError(f"Saving the checkpoint '{path}' failed on rank {rank} with {failure}: {fix}.")


def _describe(error: BaseException) -> str:
    message = " ".join(str(error).split()).rstrip(".")
    return f"{type(error).__name__} ({message})" if message else type(error).__name__
