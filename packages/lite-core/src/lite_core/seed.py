"""Seeding of every random number generator a training loop touches."""

from __future__ import annotations

import os
import random
import sys
import warnings

import torch

_SEED_VARIABLE = "LITE_GLOBAL_SEED"
_WORKERS_VARIABLE = "LITE_SEED_WORKERS"
_MAX_SEED = 2**32 - 1
#: Apart from rank to rank more than any worker index, so no two (rank, worker) pairs share a seed.
_RANK_STRIDE = 1_000_003


def seed_everything(seed: int | None = None, workers: bool = True) -> int:
    """Seed Python's `random`, NumPy (if installed) and torch on every device; returns the seed.

    Args:
        seed: the seed; defaults to `$LITE_GLOBAL_SEED`, or a random one (with a warning).
        workers: also seed each dataloader worker of dataloaders set up afterwards, from the
            seed, the worker's index and the process's rank, so no two workers share a stream.
    """
    if seed is None:
        seed = _seed_from_environment()
        if _SEED_VARIABLE not in os.environ:
            warnings.warn(f"seed_everything() chose the random seed {seed}; pass seed= to repeat this run.",
                          stacklevel=2)
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed} is out of range: pass a seed between 0 and {_MAX_SEED}.")
    os.environ[_SEED_VARIABLE] = str(seed)
    os.environ[_WORKERS_VARIABLE] = "1" if workers else "0"
    _seed_generators(seed)
    return seed


def _seed_from_environment() -> int:
    raw = os.environ.get(_SEED_VARIABLE)
    if raw is None:
        return random.randint(0, _MAX_SEED)
    try:
        return int(raw)
    except ValueError:
        from lite_core.errors import ConfigurationError

        raise ConfigurationError(
            f"{_SEED_VARIABLE}={raw!r} is not a seed: set LITE_GLOBAL_SEED to an integer or unset it."
        ) from None


def seed_for_samplers() -> int:
    """The seed `seed_everything` set in this process (or its launcher), 0 where none ran: what the
    samplers that `setup_dataloaders` puts in shuffle with, alike on every rank."""
    return _seed_from_environment() if _SEED_VARIABLE in os.environ else 0


def worker_seeding_enabled() -> bool:
    """Whether `seed_everything(workers=True)` ran in this process (or its launcher)."""
    return os.environ.get(_WORKERS_VARIABLE) == "1"


def seed_worker(worker_id: int, rank: int) -> None:
    """Seed `random`, NumPy and torch in a dataloader worker from torch's per-worker seed and the
    process's rank.

    Torch's per-worker seed is drawn in the main process, which every rank seeded alike: without
    the rank, worker `w` would draw the same numbers on every rank.
    """
    seed = (torch.initial_seed() + rank * _RANK_STRIDE) % (_MAX_SEED + 1)
    _seed_generators(seed)


def _seed_generators(seed: int) -> None:
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    torch.manual_seed(seed)
