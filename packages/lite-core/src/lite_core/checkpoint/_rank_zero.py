"""Writing a checkpoint on rank 0 with every rank told whether it worked, so that a failed save
stops every rank at `save` instead of leaving the others to fail later, elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

from lite_core.errors import CheckpointError

if TYPE_CHECKING:
    from lite_core.strategies.strategy import Strategy

T = TypeVar("T")


def on_rank_zero(strategy: Strategy, path: str, action: Callable[[], T]) -> T:
    """`action()` on rank 0 only, its result broadcast to every rank.

    If `action` raises on rank 0, every rank raises a `CheckpointError` naming that error (on
    rank 0 the original error is its cause). Every rank must call this, as it is a collective.
    """
    result: Any = None
    error: Exception | None = None
    if strategy.global_rank == 0:
        try:
            result = action()
        except Exception as err:  # told to every rank below; KeyboardInterrupt etc. stop as they are
            error = err
    failure, result = strategy.broadcast((None if error is None else _describe(error), result))
    if failure is not None:
        raise CheckpointError(
            f"Saving the checkpoint '{path}' failed on rank 0 with {failure}: fix that cause (free disk"
            " space, remove what is in the way, or save only tensors, plain values and objects with"
            " state_dict()) and save again."
        ) from error
    return result


def _describe(error: Exception) -> str:
    message = " ".join(str(error).split()).rstrip(".")
    return f"{type(error).__name__} ({message})" if message else type(error).__name__
