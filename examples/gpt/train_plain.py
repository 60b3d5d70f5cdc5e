"""Train the character-level GPT with plain PyTorch, on one process. Compare with train_lite.py:

    diff examples/gpt/train_plain.py examples/gpt/train_lite.py
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from data_and_model import GPT, CharTokenizer, generate, make_dataset


def train(args: argparse.Namespace) -> float:
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer()
    model = GPT(tokenizer.vocab_size, args.block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(make_dataset(tokenizer, args.block_size), batch_size=args.batch_size, shuffle=True)

    step = 0
    while step < args.steps:
        for tokens, targets in loader:
            optimizer.zero_grad()
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            step += 1
            if step % 50 == 0 or step == args.steps:
                print(f"step {step}/{args.steps}  loss {loss.item():.4f}")
            if step == args.steps:
                break

    model.eval()
    sample = generate(model, tokenizer.encode("The keeper"), 60, args.block_size)
    print(f"sample: {tokenizer.decode(sample)!r}")
    return loss.item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


if __name__ == "__main__":
    print(f"final loss {train(parse_args())!r}")
