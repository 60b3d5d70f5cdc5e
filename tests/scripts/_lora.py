"""The LoRA fine-tuning that the fine-tuning jobs run through Lite and the tests replay with plain
peft: a tiny Llama built from a config (no download; its rotary embedding keeps buffers, which
DDP broadcasts in its forward), LoRA adapters from peft on the attention projections, AdamW over
the trainable parameters only, fixed global batches.
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


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def base_model() -> Any:
    """The pretrained model a user would download, here built from a config with a fixed seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(llama_config())


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


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
