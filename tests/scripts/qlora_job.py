"""QLoRA through Lite (`QuantizedPrecision`) beside the same job by hand: what
`tests/integration/test_qlora.py` runs.

    python qlora_job.py STRATEGY DEVICES OUT_DIR MODE [built]

The tiny Llama of `_lora.py` with peft's LoRA adapters is set up with `precision=QuantizedPrecision(MODE, ...)`
and trains `_lora.STEPS` steps on global batches split over the processes. After the first step it
saves an adapters-only checkpoint (`trainable_state(model)` and the optimizer) and a whole one (the
model, quantized base included). Then, on the same processes, the same model quantized by hand with
bitsandbytes (`_qlora.quantize_by_hand`, wrapped in torch's `DistributedDataParallel` when there are
two processes) trains on the very batches each process got. Rank 0 writes `OUT_DIR/record.pt`:
losses and adapters of both, Lite's and the hand model's quantized base, the checkpoints' keys, and
the adapters of two fresh models (other adapters; for the whole checkpoint also another base) that
loaded a checkpoint and trained the remaining steps.

With `built`, every model's base is built with its 4-bit layers inside `init_module(empty_init=True)`
and loaded from full-precision weights before peft adds the adapters, and the hand model is
quantized before peft too (the order of transformers' `from_pretrained` with a bitsandbytes config).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import _lora
from _lora_loop import LoRALoop
import _qlora
from lite_core import QuantizedPrecision

torch.set_num_threads(1)
OTHER_SEED = 99


class QLoRA(LoRALoop):
    def run(self, out_dir: str, mode: str, built: bool = False) -> dict[str, Any]:
        out = Path(out_dir)
        self.built = built
        model = self._lora_model()
        model, optimizer = self.setup(model, _lora.optimizer_for(model))
        losses, seen = [], []
        for step, (tokens,) in enumerate(self._batches()):
            seen.append(tokens)
            losses.append(self._step(model, optimizer, tokens))
            if step == 0:
                self.save({"adapters": self.trainable_state(model), "optimizer": optimizer}, out / "adapters.ckpt")
                self.save({"model": model, "optimizer": optimizer}, out / "whole.ckpt")
        record = {"losses": losses, "adapters": self._adapters(model), "base": _qlora.quantized_base(model.state_dict()),
                  "adapters_keys": sorted(self.load(out / "adapters.ckpt")["adapters"]),
                  "whole_keys": sorted(self.load(out / "whole.ckpt")["model"]),
                  "resumed_adapters": self._resumed(out / "adapters.ckpt", "adapters", base_seed=_lora.SEED),
                  "resumed_whole": self._resumed(out / "whole.ckpt", "model", base_seed=_lora.SEED + 50),
                  **self._by_hand(mode, seen)}
        if self.built:
            record["layers_as_built"] = self.layers_as_built
        if self.is_global_zero:
            torch.save(record, out / "record.pt")
        return record

    def _adapters(self, model: Any) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def _resumed(self, path: Path, key: str, base_seed: int) -> dict[str, torch.Tensor]:
        """A model with other adapters (and, for `base_seed` != SEED, another base) loads the
        checkpoint at `path` and trains the remaining steps."""
        seed, _lora.SEED = _lora.SEED, base_seed
        try:
            model = self._lora_model(adapter_seed=OTHER_SEED)
        finally:
            _lora.SEED = seed
        model, optimizer = self.setup(model, _lora.optimizer_for(model))
        self.load(path, {key: self.trainable_state(model) if key == "adapters" else model, "optimizer": optimizer})
        for step, (tokens,) in enumerate(self._batches()):
            if step > 0:
                self._step(model, optimizer, tokens)
        return self._adapters(model)

    def _lora_model(self, adapter_seed: int = _lora.SEED + 1) -> Any:
        """The base with LoRA adapters; `built`: the base built with its 4-bit layers inside
        `init_module(empty_init=True)` and loaded from the full-precision weights a user
        downloads, before peft adds the adapters (bitsandbytes' `from_pretrained` order)."""
        if not self.built:
            return _lora.lora_model(adapter_seed)
        from peft import get_peft_model

        with self.init_module(empty_init=True):
            base = _lora.model_class()(_lora.config())
        self.layers_as_built = sorted({type(m).__name__ for n, m in base.named_modules() if n.endswith("_proj")})
        base.load_state_dict(_lora.base_model().state_dict())  # quantized as it arrives
        torch.manual_seed(adapter_seed)
        return get_peft_model(base, _lora.lora_config())

    def _by_hand(self, mode: str, batches: list[torch.Tensor]) -> dict[str, Any]:
        """The same job with bitsandbytes applied by hand, on this process's same batches."""
        plain = _qlora.qlora_model_by_hand(mode, quantize_first=self.built)
        model = torch.nn.parallel.DistributedDataParallel(plain) if self.world_size > 1 else plain
        optimizer = _lora.optimizer_for(plain)
        losses = []
        for tokens in batches:
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        return {"hand_losses": losses, "hand_adapters": self._adapters(plain),
                "hand_base": _qlora.quantized_base(plain.state_dict())}


def precision_for(mode: str) -> QuantizedPrecision:
    return QuantizedPrecision(mode, compute_dtype=_qlora.MODES[mode])


if __name__ == "__main__":
    strategy, devices, out_dir, mode = sys.argv[1:5]
    QLoRA(accelerator="cpu", strategy=strategy, devices=int(devices), precision=precision_for(mode)).run(
        out_dir, mode, built=sys.argv[5:] == ["built"])
