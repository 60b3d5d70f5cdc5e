"""A tiny Hugging Face GPT-2, built from a config (nothing is downloaded), and a character dataset."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

TEXT = ("Lite keeps your training loop. You choose the hardware and the strategy in the constructor, "
        "and the loop runs unchanged on one CPU, on many processes, or sharded. ") * 8
BLOCK = 16


class CharTokenizer:
    """Characters of `TEXT` to ids and back (a stand-in for a Hugging Face tokenizer)."""

    def __init__(self) -> None:
        self.chars = sorted(set(TEXT))
        self.ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([[self.ids[c] for c in text]])

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def make_dataset(tokenizer: CharTokenizer) -> TensorDataset:
    """Every window of `BLOCK` characters; the model shifts the labels itself."""
    ids = tokenizer.encode(TEXT)[0]
    windows = ids.unfold(0, BLOCK, BLOCK // 2)
    return TensorDataset(windows)


def make_model(tokenizer: CharTokenizer) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(config)
