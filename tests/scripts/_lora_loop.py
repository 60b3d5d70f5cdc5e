"""The fine-tuning loop the LoRA jobs share (lora_job.py, qlora_job.py, nf4_job.py): `_lora.py`'s
global batches split over the processes, and one step as a peft user writes it."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

import _lora
from lite_core import LightningLite


class LoRALoop(LightningLite):
    """A `LightningLite` with the jobs' batches and step; each job's `run()` is its own."""

    def _batches(self) -> Any:
        return self.setup_dataloaders(DataLoader(_lora.data(), batch_size=_lora.GLOBAL_BATCH), split_batches=True)

    def _step(self, model: Any, optimizer: Any, tokens: torch.Tensor) -> float:
        """One step on `tokens`; the loss averaged over the processes."""
        loss = model(input_ids=tokens, labels=tokens).loss
        self.backward(loss, model=model)
        optimizer.step()
        optimizer.zero_grad()
        return self.all_reduce(loss.detach(), reduce_op="mean").item()
