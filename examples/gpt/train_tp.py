"""Train the character-level GPT with tensor parallelism x FSDP2 through Lite: the loop of
train_lite.py with `ModelParallelStrategy` and the plan in tensor_parallel.py.

    python examples/gpt/train_tp.py --devices 4                           # dp1 x tp4 on CPU (auto: tp within a node)
    python examples/gpt/train_tp.py --devices 4 --data-parallel-size 2    # dp2 x tp2
    lite run --devices 4 examples/gpt/train_tp.py

Compare with train_tp_plain.py, the same training in plain PyTorch (started with torchrun).
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from data_and_model import GPT, CharTokenizer, generate, make_dataset
from lite_core import LightningLite
from lite_core.strategies import ModelParallelStrategy
from tensor_parallel import parallelize


class TrainGPT(LightningLite):
    def run(self, args: argparse.Namespace) -> float:
        self.seed_everything(args.seed)
        tokenizer = CharTokenizer()
        model = GPT(tokenizer.vocab_size, args.block_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        model, optimizer = self.setup(model, optimizer)
        loader = DataLoader(make_dataset(tokenizer, args.block_size), batch_size=args.batch_size, shuffle=True)
        loader = self.setup_dataloaders(loader)
        dp, tp = self.strategy.mesh_shape
        self.print(f"training on {self.world_size} process(es): data parallel {dp} x tensor parallel {tp}")

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
        # Every process takes part in a tensor-parallel forward pass; rank 0 prints.
        sample = generate(model, self.to_device(tokenizer.encode("The keeper")), 60, args.block_size)
        self.print(f"sample: {tokenizer.decode(sample)!r}")
        return self.all_reduce(loss.detach()).item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per data-parallel rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--data-parallel-size", default="auto")
    parser.add_argument("--tensor-parallel-size", default="auto")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--precision", default="32-true")
    return parser.parse_args()


def _size(value: str) -> int | str:
    return value if value == "auto" else int(value)


if __name__ == "__main__":
    args = parse_args()
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=_size(args.data_parallel_size),
                                     tensor_parallel_size=_size(args.tensor_parallel_size))
    lite = TrainGPT(accelerator=args.accelerator, strategy=strategy, devices=args.devices, precision=args.precision)
    final_loss = lite.run(args)
    if lite.is_global_zero:
        print(f"final loss {final_loss!r}")
