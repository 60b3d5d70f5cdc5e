"""Rank 0 alone calls a method of the set-up model with tensors among its arguments, as peft and
Accelerate users save gathered weights: `model.save_pretrained(folder, state_dict=full)`. What
`tests/integration/test_rank_zero_method.py` runs.

    python rank_zero_method.py STRATEGY OUT_DIR

STRATEGY: `ddp` or `fsdp` (2 processes). A tiny Llama with LoRA adapters (`_lora.py`; its rotary
embedding has buffers, which DDP broadcasts in every forward) trains one step; every rank takes
`full_state_dict(model)`, rank 0 alone calls `save_pretrained(OUT_DIR/adapter, state_dict=full)`
while rank 1 waits in a barrier, and rank 0 writes the full state to OUT_DIR/full.pt. Had the call
run as a forward pass, rank 0 would wait in DDP's buffer broadcast or FSDP's all-gather for a
rank that never comes, until the collective timeout.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import _lora
from lite_core import LightningLite

torch.set_num_threads(1)


class RankZeroMethod(LightningLite):
    def run(self, out_dir: str) -> None:
        out = Path(out_dir)
        model = _lora.lora_model()
        model, optimizer = self.setup(model, _lora.optimizer_for(model))
        (tokens,) = _lora.data()[:_lora.GLOBAL_BATCH]
        self.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        full = self.full_state_dict(model)
        if self.is_global_zero:
            model.save_pretrained(out / "adapter", state_dict=full)
            torch.save(full, out / "full.pt")
        self.barrier()


def strategy_for(name: str) -> Any:
    if name != "fsdp":
        return name
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lite_core.strategies import FSDPStrategy

    return FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})


if __name__ == "__main__":
    strategy, out_dir = sys.argv[1:3]
    RankZeroMethod(accelerator="cpu", strategy=strategy_for(strategy), devices=2).run(out_dir)
