"""Train a tiny Hugging Face GPT-2 with Lite: the loop of train_plain.py, hardware chosen by arguments.

    python examples/huggingface/train_lite.py --strategy ddp --devices 2
    python examples/huggingface/train_lite.py --strategy fsdp --devices 2   # each GPT2Block sharded
    python examples/huggingface/train_lite.py --precision bf16-mixed        # generate() too runs in bf16
    python examples/huggingface/train_lite.py                               # one process, bit for bit train_plain.py

`model.generate(...)` is called on the model `setup()` returned: like `model(...)`, it runs under
the precision and through the strategy (under fsdp it gathers the sharded weights it needs).
The checkpoint holds the plain model's keys: `GPT2LMHeadModel(config).load_state_dict(...)` takes it.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from data_and_model import CharTokenizer, make_dataset, make_model
from lite_core import LightningLite
from lite_core.strategies import FSDPStrategy


class TrainGPT2(LightningLite):
    def run(self, args: argparse.Namespace) -> float:
        self.seed_everything(args.seed)
        tokenizer = CharTokenizer()
        model = make_model(tokenizer)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=args.steps // 10, num_training_steps=args.steps)
        model, optimizer = self.setup(model, optimizer)
        loader = self.setup_dataloaders(DataLoader(make_dataset(tokenizer), batch_size=args.batch_size, shuffle=True))
        self.print(f"training on {self.world_size} process(es), strategy {self.strategy.name}")

        step = 0
        while step < args.steps:
            for (tokens,) in loader:
                optimizer.zero_grad()
                loss = model(input_ids=tokens, labels=tokens).loss
                self.backward(loss)
                optimizer.step()
                schedule.step()
                step += 1
                if step % 50 == 0 or step == args.steps:
                    self.print(f"step {step}/{args.steps}  loss {self.all_reduce(loss.detach()).item():.4f}")
                if step == args.steps:
                    break

        model.eval()
        with torch.no_grad():  # on every rank: under fsdp, generate gathers weights from all of them
            sample = model.generate(self.to_device(tokenizer.encode("Lite keeps")), max_new_tokens=40, do_sample=False)
        self.print(f"sample: {tokenizer.decode(sample[0].tolist())!r}")
        if args.checkpoint:  # the plain model's keys, whatever the strategy
            self.save({"model": model}, args.checkpoint)
        return self.all_reduce(loss.detach()).item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", help="where to save the trained model (e.g. gpt2.ckpt)")
    for choice in ("accelerator", "strategy", "devices", "precision"):
        parser.add_argument(f"--{choice}")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    choices = {k: getattr(args, k) for k in ("accelerator", "strategy", "devices", "precision")}
    if choices["strategy"] == "fsdp":  # one sharded unit per transformer block, as for any transformer
        choices["strategy"] = FSDPStrategy(auto_wrap_policy={GPT2Block}, state_dict_type="full")
    lite = TrainGPT2(**{k: v for k, v in choices.items() if v is not None})
    final_loss = lite.run(args)
    if lite.is_global_zero:
        print(f"final loss {final_loss!r}")
