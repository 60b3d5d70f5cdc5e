"""LoRA fine-tuning through Lite as a peft user writes it: what `tests/integration/test_fine_tuning.py` runs.

    python lora_job.py STRATEGY DEVICES OUT_DIR [KIND]

STRATEGY is a strategy's name (`deepspeed_stage_2` and `deepspeed_stage_3` run from
packages/lite-deepspeed/tests/test_zero_fine_tuning.py, which merges under ZeRO-2 only).

A tiny Llama (or GPT-2, KIND=gpt2) with peft's LoRA adapters (`_lora.py`) trains `_lora.STEPS` steps on global batches
that `setup_dataloaders(split_batches=True)` splits over the processes. After the first step the
job saves an adapters-only checkpoint (`trainable_state(model)` and the optimizer) to
OUT_DIR/checkpoint. At the end:

- rank 0 writes `OUT_DIR/record.pt`: the per-step losses (averaged over the processes), the
  trained adapters (`full_state_dict(model, trainable_only=True)`), the keys the checkpoint holds,
  and the adapters of a second model, its LoRA weights drawn from another seed, that loaded the
  checkpoint and trained the remaining steps;
- rank 0 alone calls peft's `model.save_pretrained(OUT_DIR/adapter, state_dict=adapters)`;
- every rank merges the adapters into the base (`model.merge_and_unload()`) and exports the merged
  base with `export_safetensors` to OUT_DIR/merged, beside which rank 0 writes the config (not
  under ZeRO-3).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import _lora
from _lora_loop import LoRALoop

torch.set_num_threads(1)
#: A fresh model's adapters start from another draw than the trained one's: a checkpoint that
#: did not load them would show.
OTHER_SEED = 99


class FineTune(LoRALoop):
    def run(self, out_dir: str, merge: bool = True) -> None:
        out = Path(out_dir)
        model = _lora.lora_model()
        model, optimizer = self.setup(model, _lora.optimizer_for(model))
        losses = []
        for step, (tokens,) in enumerate(self._batches()):
            losses.append(self._step(model, optimizer, tokens))
            if step == 0:
                self.save({"adapters": self.trainable_state(model), "optimizer": optimizer}, out / "checkpoint")
        adapters = self.full_state_dict(model, trainable_only=True)
        record = {"losses": losses, "adapters": adapters, "checkpoint_keys": self._checkpoint_keys(out / "checkpoint"),
                  "resumed": self._resumed(out / "checkpoint")}
        if self.is_global_zero:
            torch.save(record, out / "record.pt")
            model.save_pretrained(out / "adapter", state_dict=adapters)  # rank 0 alone, as peft users do
            _lora.config().save_pretrained(out / "merged")
        self.barrier()
        if merge:  # not under ZeRO-3, whose partitions peft cannot merge into (docs/fine-tuning.md)
            self.export_safetensors(model.merge_and_unload(), out / "merged")

    def _checkpoint_keys(self, path: Path) -> dict[str, list[str]]:
        content = self.load(path)
        return {"adapters": sorted(content["adapters"]), "optimizer_state": len(content["optimizer"]["state"])}

    def _resumed(self, path: Path) -> dict[str, Any]:
        """A second model with other adapters loads the checkpoint and trains the remaining steps."""
        model = _lora.lora_model(adapter_seed=OTHER_SEED)
        model, optimizer = self.setup(model, _lora.optimizer_for(model))
        self.load(path, {"adapters": self.trainable_state(model), "optimizer": optimizer})
        for step, (tokens,) in enumerate(self._batches()):
            if step > 0:
                self._step(model, optimizer, tokens)
        return self.full_state_dict(model, trainable_only=True)


def strategy_for(name: str) -> Any:
    if name == "model_parallel":
        from lite_core.strategies import ModelParallelStrategy

        return ModelParallelStrategy(_shard_blocks, data_parallel_size=2, tensor_parallel_size=1)
    if name != "fsdp":
        return name
    from lite_core.strategies import FSDPStrategy

    return FSDPStrategy(auto_wrap_policy={_lora.block_class()})  # sharded checkpoints


def _shard_blocks(model: Any, device_mesh: Any) -> Any:
    """The user's `parallelize_fn` under `model_parallel`: FSDP2 over each decoder block, then the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for module in model.modules():
        if isinstance(module, _lora.block_class()):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


if __name__ == "__main__":
    strategy, devices, out_dir = sys.argv[1:4]
    _lora.KIND = sys.argv[4] if len(sys.argv) > 4 else "llama"
    FineTune(accelerator="cpu", strategy=strategy_for(strategy), devices=int(devices)).run(
        out_dir, merge=strategy != "deepspeed_stage_3")
