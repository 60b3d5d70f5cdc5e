"""A tiny Llama from a config, trained 3 steps and exported as Hugging Face safetensors: what
`tests/integration/test_hf_export.py` runs.

    python export_hf.py STRATEGY OUT_DIR [URL]

STRATEGY: `fsdp` (2 processes) or `model_parallel` (4 processes: data parallel 2 x tensor
parallel 2, `fully_shard` over the data dimension). The job exports into OUT_DIR/export (and into
URL when given) and rank 0 writes OUT_DIR/config.json's model config and OUT_DIR/trained.pt, the
model's whole trained state (`full_state_dict`), which the test compares the export with.

Then the other way: rank 0 has `transformers` save a fresh model of the same config
(OUT_DIR/saved_by_transformers, several files and their index), and every rank builds the model
inside `init_module(empty_init=True)`, sets it up and `load_safetensors` it. Rank 0 writes
OUT_DIR/loaded.pt: the loaded model's whole state, its logits on fixed tokens, how many
parameter elements rank 0 held after the load and how many the whole model has.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lite_core import LightningLite

torch.set_num_threads(1)


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def tensor_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    """Attention and MLP projections split over the tensor-parallel dimension, then sharded over the data one."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tensor_parallel"], plan)
    return fully_shard(model, mesh=mesh["data_parallel"])


class Export(LightningLite):
    def run(self, out_dir: str, url: str | None) -> None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(config())
        model, optimizer = self.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            tokens = torch.randint(0, 64, (4, 12), generator=generator)
            optimizer.zero_grad()
            self.backward(model(input_ids=tokens, labels=tokens).loss)
            optimizer.step()
        out = Path(out_dir)
        self.export_safetensors(model, out / "export", max_file_bytes=40_000)  # several files
        if url is not None:
            self.export_safetensors(model, url, max_file_bytes=40_000)
        trained = self.full_state_dict(model)
        if self.global_rank == 0:
            config().save_pretrained(out)
            torch.save(trained, out / "trained.pt")
        self.load_what_transformers_saved(out)

    def load_what_transformers_saved(self, out: Path) -> None:
        from transformers import LlamaForCausalLM

        saved = out / "saved_by_transformers"
        if self.global_rank == 0:
            torch.manual_seed(7)
            LlamaForCausalLM(config()).save_pretrained(saved, max_shard_size="40KB")
        self.barrier()
        with self.init_module(empty_init=True):
            model = LlamaForCausalLM(config())
        whole = sum(p.numel() for p in model.parameters())
        on_meta = all(p.is_meta for p in model.parameters())
        model = self.setup_module(model)
        self.load_safetensors(model, saved)
        held = sum(_local(p).numel() for p in model.parameters())
        tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        loaded = self.full_state_dict(model)
        if self.global_rank == 0:
            torch.save({"state": loaded, "logits": _local(logits), "held": held, "whole": whole, "on_meta": on_meta}, out / "loaded.pt")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (a DTensor's local shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def strategy(name: str) -> Any:
    if name == "model_parallel":
        from lite_core.strategies import ModelParallelStrategy

        return ModelParallelStrategy(tensor_parallel, data_parallel_size=2, tensor_parallel_size=2)
    return name


if __name__ == "__main__":
    devices = 4 if sys.argv[1] == "model_parallel" else 2
    Export(accelerator="cpu", strategy=strategy(sys.argv[1]), devices=devices).run(
        sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
