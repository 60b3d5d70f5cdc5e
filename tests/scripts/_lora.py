"""The LoRA fine-tuning that the fine-tuning jobs run through Lite and the tests replay with plain
peft: a tiny Llama or GPT-2 built from a config (no download; Llama's rotary embedding keeps
buffers, which DDP broadcasts in its forward; GPT-2 ties its head to its input embedding), LoRA
adapters from peft on the attention projections, AdamW over the trainable parameters only, fixed
global batches. `KIND` ("llama" or "gpt2") picks the model; the jobs set it from their arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

SEED = 11
STEPS = 3
GLOBAL_BATCH = 4
SEQUENCE = 8
VOCAB = 64
LR = 1e-2
KIND = "llama"


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def config() -> Any:
    return llama_config() if KIND == "llama" else gpt2_config()


def model_class() -> Any:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return LlamaForCausalLM if KIND == "llama" else GPT2LMHeadModel


def block_class() -> Any:
    """The decoder block, `fsdp`'s unit of sharding."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer if KIND == "llama" else GPT2Block


def base_model() -> Any:
    """The pretrained model a user would download, here built from a config with a fixed seed."""
    torch.manual_seed(SEED)
    return model_class()(config())


def lora_config() -> Any:
    from peft import LoraConfig

    targets = ["q_proj", "v_proj"] if KIND == "llama" else ["c_attn"]
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM",
                      fan_in_fan_out=KIND == "gpt2")  # GPT-2's Conv1D holds its weight transposed


def lora_model(adapter_seed: int = SEED + 1) -> Any:
    """The base with fresh LoRA adapters (peft draws their initial weights from torch's generator,
    seeded with `adapter_seed`)."""
    from peft import get_peft_model

    base = base_model()
    torch.manual_seed(adapter_seed)
    return get_peft_model(base, lora_config())


def optimizer_for(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED + 2)
    return TensorDataset(torch.randint(3, VOCAB, (STEPS * GLOBAL_BATCH, SEQUENCE), generator=generator))


def probe() -> torch.Tensor:
    """Fixed tokens on which two models with the same weights give the same logits."""
    return torch.randint(3, VOCAB, (2, SEQUENCE), generator=torch.Generator().manual_seed(SEED + 3))


def plain_losses_and_model() -> tuple[list[float], Any]:
    """Per-step losses of the same fine-tuning with plain peft in one process, and the trained model."""
    model = lora_model()
    optimizer = optimizer_for(model)
    dataset, losses = data(), []
    for step in range(STEPS):
        (tokens,) = dataset[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model
