"""Which passes over a set-up loader evaluate: the rule `setup_dataloaders(sharding="auto")` applies.

An evaluation pass reads every sample once (no padding), a training pass as many samples on every
rank; `LightningLite` asks this module which shard a pass starts on, and refuses a `backward()`
inside a pass it sharded for evaluation.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader

from lite_core.data import _sharding as _data
from lite_core.errors import MisuseError

if TYPE_CHECKING:
    from lite_core.model._module import LiteModule

#: What `setup_dataloaders(sharding=...)` accepts.
SHARDINGS = ("auto", "training", "evaluation")


def check_sharding(sharding: str) -> None:
    """Refuse a `sharding` that `setup_dataloaders` does not know, in one sentence."""
    if sharding not in SHARDINGS:
        choices = ", ".join(map(repr, SHARDINGS))
        raise MisuseError(f"setup_dataloaders() got sharding={sharding!r}: pass one of {choices}.")


class EvaluationPasses:
    """The evaluation shards of one `LightningLite`'s loaders, judged against its set-up models."""

    def __init__(self, models: list[LiteModule]) -> None:
        self._models = models  # the Lite's own list: models set up later count too
        self._passes: weakref.WeakSet[_data.EvaluationPass] = weakref.WeakSet()

    def shard(self, dataloader: DataLoader, shard: dict[str, int], seed: int,
              sharding: str) -> _data.EvaluationPass | None:
        """The evaluation shard of `dataloader` and when it applies (`None`: never)."""
        if sharding == "training":
            return None
        loader = _data.distribute_for_evaluation(dataloader, shard["num_replicas"], shard["rank"], seed)
        if not _data.is_evaluation_shard(loader):
            return None  # the dataset or the user's sampler decides what each rank reads
        applies = self.evaluating if sharding == "auto" else _always
        evaluation = _data.EvaluationPass(loader, applies, automatic=sharding == "auto")
        self._passes.add(evaluation)
        return evaluation

    def evaluating(self) -> bool:
        """Whether a pass over a loader set up with `sharding="auto"` starting now evaluates."""
        if not torch.is_grad_enabled():
            return True
        return bool(self._models) and not any(model.training for model in self._models)

    def check_not_evaluating(self) -> None:
        """Refuse a `backward()` inside a pass that Lite sharded for evaluation by its own rule."""
        if any(p.running and p.automatic for p in self._passes):
            raise MisuseError(
                "backward() ran inside a pass over a dataloader that Lite sharded for evaluation (the pass began"
                " with gradients disabled or every set-up model in eval mode): call model.train() and iterate"
                " with gradients enabled, or set the loader up with setup_dataloaders(..., sharding='training')."
            )


def _always() -> bool:
    return True
