"""QLoRA on torchao's NF4 through Lite (`precision="nf4-torchao"`) beside the same job by hand: what
`tests/integration/test_nf4_torchao.py` runs.

    python nf4_job.py STRATEGY DEVICES OUT_DIR

A Llama from a config (hidden 256: each NF4 weight, and each half of one, holds whole blocks of
torchao's default sizes), peft's LoRA on `q_proj` and `v_proj`, AdamW over the adapters, global
batches split over the processes. After the first step the job saves an adapters-only checkpoint
(`trainable_state(model)` with the optimizer) and a whole one. Then, on the same processes, the same
model with its frozen Linears given NF4 weights by hand (`to_nf4`, `linear_nf4`), sharded with
`fully_shard` per decoder layer and at the root under `fsdp` (what `FSDPStrategy(auto_wrap_policy=...)`
does) and `model_parallel` (what its `parallelize_fn` here does), trains on the very batches each process got. (Not under `ddp`: its broadcast of the parameters
corrupts an `NF4Tensor`'s statistics, by hand too, so Lite refuses it there.) Rank 0 writes `OUT_DIR/record.pt`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import _lora
from _lora_loop import LoRALoop

torch.set_num_threads(1)
OTHER_SEED = 99


def config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=_lora.VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def lora_model(adapter_seed: int = _lora.SEED + 1) -> Any:
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(_lora.SEED)
    base = LlamaForCausalLM(config())
    torch.manual_seed(adapter_seed)
    return get_peft_model(base, _lora.lora_config())


class HandNF4Linear(nn.Module):
    """A frozen Linear on torchao's NF4, written by hand as a torchao user writes it."""

    def __init__(self, layer: nn.Linear) -> None:
        from torchao.quantization import to_nf4

        super().__init__()
        self.weight = nn.Parameter(to_nf4(layer.weight.detach()), requires_grad=False)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias


def nf4_by_hand(model: nn.Module) -> nn.Module:
    for name, layer in list(model.named_modules()):
        if type(layer) is nn.Linear and not name.endswith("lm_head") and "lora_" not in name:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, HandNF4Linear(layer))
    return model


def decoder_layer() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


class NF4Job(LoRALoop):
    def run(self, out_dir: str, strategy: str) -> dict[str, Any]:
        out = Path(out_dir)
        model = lora_model()
        model, optimizer = self.setup(model, _lora.optimizer_for(model))
        losses, seen = [], []
        for step, (tokens,) in enumerate(self._batches()):
            seen.append(tokens)
            losses.append(self._step(model, optimizer, tokens))
            if step == 0:
                self.save({"adapters": self.trainable_state(model), "optimizer": optimizer}, out / "adapters.ckpt")
                self.save({"model": model}, out / "whole.ckpt")
        whole = self.load(out / "whole.ckpt")["model"]
        record = {"losses": losses, "adapters": self.full_state_dict(model, trainable_only=True),
                  "layer": type(model.get_submodule("base_model.model.model.layers.0.mlp.up_proj")).__name__,
                  "whole_types": sorted({type(v).__name__ for v in whole.values()}),
                  "whole_up_proj": whole["base_model.model.model.layers.0.mlp.up_proj.weight"],
                  "resumed": self._resumed(out / "adapters.ckpt"), "reloaded_up_proj": self._reloaded(out / "whole.ckpt"),
                  **self._by_hand(strategy, seen)}
        if self.is_global_zero:
            torch.save(record, out / "record.pt")
        return record

    def _resumed(self, path: Path) -> dict[str, torch.Tensor]:
        """A model with other adapters loads the adapters-only checkpoint and trains the remaining steps."""
        model = lora_model(adapter_seed=OTHER_SEED)
        model, optimizer = self.setup(model, _lora.optimizer_for(model))
        self.load(path, {"adapters": self.trainable_state(model), "optimizer": optimizer})
        for step, (tokens,) in enumerate(self._batches()):
            if step > 0:
                self._step(model, optimizer, tokens)
        return self.full_state_dict(model, trainable_only=True)

    def _reloaded(self, path: Path) -> torch.Tensor:
        """The whole checkpoint loaded into a model set up from another base: its NF4 up_proj, as written again."""
        seed, _lora.SEED = _lora.SEED, _lora.SEED + 50
        try:
            model = lora_model()
        finally:
            _lora.SEED = seed
        model = self.setup(model)
        self.load(path, {"model": model})
        return self.full_state_dict(model).get("base_model.model.model.layers.0.mlp.up_proj.weight")

    def _by_hand(self, strategy: str, batches: list[torch.Tensor]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import fully_shard

        plain = nf4_by_hand(lora_model())
        optimizer = _lora.optimizer_for(plain)
        model = plain
        sharded = strategy in ("fsdp", "model_parallel")
        if sharded:
            for module in plain.modules():
                if isinstance(module, decoder_layer()):
                    fully_shard(module)
            model = fully_shard(plain)
            optimizer = _lora.optimizer_for(plain)  # over the sharded parameters
        losses = []
        for tokens in batches:
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        trained = [name for name, p in plain.named_parameters() if p.requires_grad]
        if sharded:
            state = get_model_state_dict(plain, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                         ignore_frozen_params=True))
        else:
            state = plain.state_dict()
        adapters = {name: state[name].detach().clone() for name in trained if name in state}  # rank 0's under fsdp
        return {"hand_losses": losses, "hand_adapters": adapters}


def _shard_layers(model: Any, device_mesh: Any) -> Any:
    """The user's `parallelize_fn` under `model_parallel`: FSDP2 over each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for module in model.modules():
        if isinstance(module, decoder_layer()):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


if __name__ == "__main__":
    strategy, devices, out_dir = sys.argv[1:4]
    lite_strategy: Any = strategy
    if strategy == "fsdp":
        from lite_core.strategies import FSDPStrategy

        lite_strategy = FSDPStrategy(auto_wrap_policy={decoder_layer()})
    elif strategy == "model_parallel":
        from lite_core.strategies import ModelParallelStrategy

        lite_strategy = ModelParallelStrategy(_shard_layers, data_parallel_size=2, tensor_parallel_size=1)
    NF4Job(accelerator="cpu", strategy=lite_strategy, devices=int(devices), precision="nf4-torchao").run(out_dir, strategy)
