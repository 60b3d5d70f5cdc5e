"""The set-up model is the model: its methods, `torch.compile`, and a Hugging Face GPT-2 through Lite.

    python set_up_model.py STRATEGY DEVICES OUT_DIR

One job runs three cases (one launch per strategy keeps CI short); rank 0 writes
`OUT_DIR/record.json`:

- `methods`: `Regressor` trained through `loss = model.training_step(x, y)` on the set-up model.
- `compiled`: `setup(torch.compile(Regressor()))` trained through `model(x)`; its checkpoint
  (model and optimizer) loads into an uncompiled set-up model and back, each giving the same output.
- `gpt2`: a tiny `GPT2LMHeadModel`, first evaluated untrained with torchmetrics' `Perplexity` over
  11 sequences (an uneven split), then trained with AdamW and `get_linear_schedule_with_warmup`, trained on
  its `ModelOutput.loss`; then `generate` on every rank, and a checkpoint of the model at
  `OUT_DIR/gpt2.ckpt` for the test to load into a fresh `GPT2LMHeadModel`. Where every rank holds
  the whole model, rank 0 alone also calls `model.num_parameters()` after the first step and
  `model.save_pretrained(OUT_DIR/gpt2-pretrained)` at the end.

Losses are per step, averaged over the ranks. `fsdp` shards each `GPT2Block` as its own unit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if len(sys.argv) > 1 and sys.argv[1].startswith("deepspeed"):
    # As tests/matrix/scenario.py: skip the JIT build (80-100 s, longer on a busy machine) of
    # DeepSpeed's shared-memory all-reduce, which only inference uses.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

import torch
from torch import nn
from torch.utils.data import DataLoader

import _set_up_models as models
from lite_core import LightningLite

torch.set_num_threads(1)


class SetUpModel(LightningLite):
    def run(self, out_dir: str) -> None:
        out = Path(out_dir)
        record = {"methods": self.methods_case(), "compiled": self.compiled_case(out), "gpt2": self.gpt2_case(out)}
        if self.is_global_zero:
            (out / "record.json").write_text(json.dumps(record))

    def _loader(self, dataset: Any) -> Any:
        return self.setup_dataloaders(DataLoader(dataset, batch_size=models.GLOBAL_BATCH // self.world_size))

    def _mean(self, loss: torch.Tensor) -> float:
        return self.all_reduce(loss.detach(), reduce_op="mean").item()

    def methods_case(self) -> dict[str, Any]:
        plain = models.regressor()
        model, optimizer = self.setup(plain, models.regressor_optimizer(plain))
        losses = []
        for x, y in self._loader(models.mlp_data()):
            loss = model.training_step(x, y)
            self.backward(loss, model=model)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(self._mean(loss))
        return {"losses": losses}

    def _compiled_regressor(self) -> tuple[Any, Any, nn.Module]:
        plain = models.regressor()
        model, optimizer = self.setup(torch.compile(plain), models.regressor_optimizer(plain))
        return model, optimizer, plain

    def _uncompiled_regressor(self) -> tuple[Any, Any]:
        plain = models.regressor()
        return self.setup(plain, models.regressor_optimizer(plain))

    def compiled_case(self, out: Path) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        model, optimizer, plain = self._compiled_regressor()
        losses = []
        for x, y in self._loader(models.mlp_data()):
            loss = nn.functional.mse_loss(model(x), y)
            self.backward(loss, model=model)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(self._mean(loss))
        with torch.no_grad():
            trained = model(models.probe())
        # Out of the compiled run into an uncompiled one, and back into a compiled one.
        self.save({"model": model, "optimizer": optimizer}, out / "compiled.ckpt")
        eager, eager_optimizer = self._uncompiled_regressor()
        self.load(out / "compiled.ckpt", {"model": eager, "optimizer": eager_optimizer})
        self.save({"model": eager, "optimizer": eager_optimizer}, out / "eager.ckpt")
        again, again_optimizer, _ = self._compiled_regressor()
        self.load(out / "eager.ckpt", {"model": again, "optimizer": again_optimizer})
        with torch.no_grad():
            outputs = {"trained": trained, "uncompiled": eager(models.probe()), "compiled_again": again(models.probe())}
        return {
            "losses": losses,
            "keys": list(model.state_dict()),
            "module_is_plain": model is plain,
            "frames_compiled": counters["frames"]["ok"],
            "outputs": {name: value.tolist() for name, value in outputs.items()},
        }

    def gpt2_case(self, out: Path) -> dict[str, Any]:
        model = models.gpt2()
        optimizer, schedule = models.gpt2_optimizer(model)
        model, optimizer = self.setup(model, optimizer)
        model.eval()  # evaluated first, untrained: the weights are exactly the plain model's
        evaluation = self.setup_dataloaders(DataLoader(models.gpt2_eval_data(), batch_size=models.EVAL_BATCH))
        perplexity = models.perplexity(model, evaluation, self.device)
        model.train()
        losses, alone = [], {}
        for (tokens,) in self._loader(models.gpt2_data()):
            output = model(input_ids=tokens, labels=tokens)
            self.backward(output.loss, model=model)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(self._mean(output.loss))
            if len(losses) == 1 and self.strategy.name in REPLICATED:
                # One rank alone, mid-training, then every rank waits for it (the Hugging Face habit).
                # Had it run as a forward pass, DDP's first forward after the first backward would
                # rebuild its buckets, a collective that rank 1, in the barrier, never joins.
                if self.is_global_zero:
                    alone["parameters"] = model.num_parameters()
                self.barrier()
        model.eval()
        tokens = models.generate(model)
        if self.is_global_zero and self.strategy.name in REPLICATED:
            model.save_pretrained(out / "gpt2-pretrained")  # the Hugging Face habit: one rank writes
        self.save({"model": model}, out / "gpt2.ckpt")
        return {"losses": losses, "tokens": self.all_gather(torch.tensor(tokens)).tolist(), "perplexity": perplexity,
                **alone}


#: Strategies whose every rank holds the whole model: there rank 0 alone may `save_pretrained`.
REPLICATED = ("single_device", "ddp", "ddp_spawn")


def strategy_for(name: str) -> Any:
    if name != "fsdp":
        return name
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from lite_core.strategies import FSDPStrategy

    return FSDPStrategy(auto_wrap_policy={GPT2Block}, state_dict_type="full")


if __name__ == "__main__":
    strategy, devices, out_dir = sys.argv[1:4]
    SetUpModel(accelerator="cpu", strategy=strategy_for(strategy), devices=int(devices)).run(out_dir)
