"""A character-level corpus (written here, nothing to download) and a small GPT-style model,
shared by both training scripts."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

TEXT = """\
The keeper of the lighthouse counted the waves each night and wrote the number in a green book.
When the fog came in from the north he lit the lamp early and listened for the bell on the reef.
Ships passed, some slow and some quick, and every one of them blinked twice when it saw the light.
In spring the gulls returned, in autumn the storms, and in winter the keeper read the green book
from the first page to the last, and found that no two nights had ever had the same number of waves.
"""


class CharTokenizer:
    """Maps each character of `TEXT` to an integer and back."""

    def __init__(self, text: str = TEXT) -> None:
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._index[c] for c in text], dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


def make_dataset(tokenizer: CharTokenizer, block_size: int) -> TensorDataset:
    """Every window of `block_size` characters, with the next character of each position as target."""
    tokens = tokenizer.encode(TEXT * 4)
    windows = tokens.unfold(0, block_size + 1, 1)
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


class CausalSelfAttention(nn.Module):
    """Separate query, key and value projections, so that a tensor-parallel plan can split each by
    heads (`tensor_parallel.py`); the head count follows from the width each process holds."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_width = width // heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (proj(x).view(batch, length, -1, self.head_width).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, `layers` pre-norm transformer blocks, a linear head."""

    def __init__(self, vocab_size: int, block_size: int, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.block_size = block_size
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)
        for parameter in self.parameters():
            if parameter.dim() > 1:
                nn.init.normal_(parameter, std=0.5 / math.sqrt(parameter.shape[-1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        return self.head(self.norm(self.blocks(x)))


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Append `length` greedily chosen tokens to the 1-D `prompt`."""
    tokens = prompt.unsqueeze(0)
    for _ in range(length):
        logits = model(tokens[:, -block_size:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0]
