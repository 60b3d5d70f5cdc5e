"""Train a tiny Hugging Face GPT-2 with plain PyTorch, on one process. Compare with train_lite.py:

    diff examples/huggingface/train_plain.py examples/huggingface/train_lite.py
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

from data_and_model import CharTokenizer, make_dataset, make_model


def train(args: argparse.Namespace) -> float:
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer()
    model = make_model(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=args.steps // 10, num_training_steps=args.steps)
    loader = DataLoader(make_dataset(tokenizer), batch_size=args.batch_size, shuffle=True)

    step = 0
    while step < args.steps:
        for (tokens,) in loader:
            optimizer.zero_grad()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            if step % 50 == 0 or step == args.steps:
                print(f"step {step}/{args.steps}  loss {loss.item():.4f}")
            if step == args.steps:
                break

    model.eval()
    with torch.no_grad():
        sample = model.generate(tokenizer.encode("Lite keeps"), max_new_tokens=40, do_sample=False)
    print(f"sample: {tokenizer.decode(sample[0].tolist())!r}")
    if args.checkpoint:
        torch.save({"model": model.state_dict()}, args.checkpoint)
    return loss.item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", help="where to save the trained model (e.g. gpt2.ckpt)")
    return parser.parse_args()


if __name__ == "__main__":
    print(f"final loss {train(parse_args())!r}")
