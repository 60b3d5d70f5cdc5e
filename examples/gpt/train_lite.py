"""Train the character-level GPT with Lite: the loop of train_plain.py, hardware chosen by arguments.

    python examples/gpt/train_lite.py --strategy ddp --devices 2
    lite run --strategy ddp --devices 2 examples/gpt/train_lite.py
    python examples/gpt/train_lite.py --precision bf16-mixed
    python examples/gpt/train_lite.py                     # one process, bit for bit train_plain.py

Choices not given here are left to `lite run` (or LITE_* variables), else Lite's defaults.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from data_and_model import GPT, CharTokenizer, generate, make_dataset
from lite_core import LightningLite


class TrainGPT(LightningLite):
    def run(self, args: argparse.Namespace) -> float:
        self.seed_everything(args.seed)
        tokenizer = CharTokenizer()
        model = GPT(tokenizer.vocab_size, args.block_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        model, optimizer = self.setup(model, optimizer)
        loader = DataLoader(make_dataset(tokenizer, args.block_size), batch_size=args.batch_size, shuffle=True)
        loader = self.setup_dataloaders(loader)
        self.print(f"training on {self.world_size} process(es), strategy {self.strategy.name}")

        step = 0
        while step < args.steps:
            for tokens, targets in loader:
                optimizer.zero_grad()
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                self.backward(loss)
                self.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                step += 1
                if step % 50 == 0 or step == args.steps:
                    self.print(f"step {step}/{args.steps}  loss {self.all_reduce(loss.detach()).item():.4f}")
                if step == args.steps:
                    break

        model.eval()
        if self.is_global_zero:
            with self.autocast():
                sample = generate(model, self.to_device(tokenizer.encode("The keeper")), 60, args.block_size)
            print(f"sample: {tokenizer.decode(sample)!r}")
        return self.all_reduce(loss.detach()).item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    for choice in ("accelerator", "strategy", "devices", "precision"):
        parser.add_argument(f"--{choice}")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    choices = {k: getattr(args, k) for k in ("accelerator", "strategy", "devices", "precision")}
    lite = TrainGPT(**{k: v for k, v in choices.items() if v is not None})
    final_loss = lite.run(args)
    if lite.is_global_zero:
        print(f"final loss {final_loss!r}")
