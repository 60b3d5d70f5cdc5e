"""QLoRA against LoRA on a bf16 base, each through Lite and by hand, on one CPU process.

    hatch run test:python benchmarks/qlora.py [--rounds 3] [--steps 6] [--hidden 256] [--out RESULTS.json]

A Llama from a config (no download: hidden 256, 4 layers, about 4.5M parameters of which 3.4M
in the blocks' Linears), loaded in bf16, with peft's LoRA (r=8) on `q_proj` and `v_proj`, AdamW over the adapters,
batches of 2 x 32 tokens (`--hidden 1024`: about 60M parameters). Five arms, each in a fresh process (the peak memory is the process's),
interleaved round by round so that a busy machine slows all alike:

- `bf16 by hand` / `bf16 lite`: the bf16 base as loaded; Lite with `precision="32-true"` (which casts
  nothing);
- `nf4 by hand` / `nf4 lite`: the frozen base Linears swapped for bitsandbytes' `Linear4bit`
  (`nf4`, bf16 compute) by hand, against `precision=QuantizedPrecision("nf4", compute_dtype=torch.bfloat16)`;
- `nf4 lite built`: the base built inside `init_module(empty_init=True)` under the same precision
  (its Linears 4-bit as the block ends, never in bf16), its bf16 weights then loaded from a file
  (memory-mapped) and quantized as they arrive, then peft and `setup`.

Per arm: the median step time, the bytes of the set-up model's state (every tensor of its state
dict: weights, bitsandbytes' statistics, adapters), the process's peak until the model is set up
(`VmHWM` less the RSS before the model was built: what building, loading and quantizing the base
cost) and its peak during the steps (`VmHWM` after resetting it at the first step, less the same
RSS; the allocator keeps what the replaced bf16 weights freed, so this peak does not fall with
the model). Reported as ratios: nf4 / bf16 (what QLoRA saves and costs on CPU), Lite / by hand
(what Lite adds; goal <= 1.02), and built / set up (what building the base 4-bit saves).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("bf16 by hand", "bf16 lite", "nf4 by hand", "nf4 lite", "nf4 lite built")


def _rss_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _config(hidden: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128)


def _base(hidden: int) -> Any:
    """The pretrained base as loaded in bf16 (here from a config, with a fixed seed)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config(hidden)).to(torch.bfloat16)


def _model(hidden: int, base: Any = None) -> Any:
    from peft import LoraConfig, get_peft_model

    if base is None:
        base = _base(hidden)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                           task_type="CAUSAL_LM"))


def _built_base(lite: Any, hidden: int, weights: Path) -> Any:
    """The base built with its 4-bit layers under `init_module(empty_init=True)`, then its bf16
    weights loaded from the file a user downloaded (memory-mapped), each quantized as it arrives."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    try:
        with lite.init_module(empty_init=True):
            base = LlamaForCausalLM(_config(hidden))
    finally:
        torch.set_default_dtype(torch.float32)
    base.load_state_dict(torch.load(weights, mmap=True, weights_only=True))
    return base


def _by_hand_nf4(model: Any) -> Any:
    import bitsandbytes as bnb
    import torch
    from torch import nn

    for name, layer in list(model.named_modules()):
        if type(layer) is not nn.Linear or name.endswith("lm_head") or "lora_" in name:
            continue
        new = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=False)
        new.weight = bnb.nn.Params4bit(layer.weight.data, requires_grad=False, quant_type="nf4",
                                       compress_statistics=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new.to("cpu"))
    return model


def _worker(arm: str, steps: int, hidden: int, weights: Path) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    baseline = _rss_mib()
    backward = torch.Tensor.backward
    if "lite" in arm:
        from lite_core import LightningLite, QuantizedPrecision

        precision = QuantizedPrecision("nf4", compute_dtype=torch.bfloat16) if arm.startswith("nf4") else "32-true"
        lite = LightningLite(accelerator="cpu", precision=precision)
        model = _model(hidden, _built_base(lite, hidden, weights) if arm.endswith("built") else None)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        model, optimizer = lite.setup(model, optimizer)
        backward = lite.backward
    else:
        model = _model(hidden)
        if arm.startswith("nf4"):
            model = _by_hand_nf4(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    set_up_peak = _rss_mib("VmHWM") - baseline
    held = sum(t.nelement() * t.element_size() for t in model.state_dict().values()) / 2**20
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    times = []
    for step in range(steps + 1):
        if step == 1:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the peak from here on
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:]), "state_mib": held, "peak_mib": _rss_mib("VmHWM") - baseline,
            "set_up_peak_mib": set_up_peak}


#: glibc raises its mmap threshold after a large block is freed, and keeps later ones in the heap,
#: which it does not give back: the RSS would then count every temporary ever freed (measured: a
#: 4-bit base built layer by layer "peaked" above the bf16 base). A fixed threshold hands large
#: blocks back when freed, so the peaks below are what was alive at once, in every arm alike.
_WORKER_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}

_SAVE_BASE = """
import sys, torch
sys.path.insert(0, {here!r})
from qlora import _base
torch.save(_base({hidden}).state_dict(), {path!r})
"""


def _ratio(results: dict[str, list[dict[str, float]]], key: str, over: str, under: str) -> float:
    return statistics.median(r[key] for r in results[over]) / statistics.median(r[key] for r in results[under])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--hidden", type=int, default=256, help="the Llama's hidden size (256: about 4.5M parameters)")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.steps, args.hidden, args.weights)))
        return
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as folder:
        weights = Path(folder) / "base.pt"  # the base's bf16 weights, as downloaded, for the built arm
        subprocess.run([sys.executable, "-c", _SAVE_BASE.format(here=str(Path(__file__).parent), hidden=args.hidden,
                                                               path=str(weights))], check=True)
        for _ in range(args.rounds):
            for arm in ARMS:
                out = subprocess.run([sys.executable, __file__, "--worker", arm, "--steps", str(args.steps),
                                      "--hidden", str(args.hidden), "--weights", str(weights)],
                                     check=True, capture_output=True, text=True, env=_WORKER_ENV).stdout
                results[arm].append(json.loads(out.strip().splitlines()[-1]))
    report = {arm: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for arm, runs in results.items()}
    report["ratios"] = {f"{key} {a} / {b}": _ratio(results, key, a, b)
                        for key in ("step_s", "state_mib", "peak_mib", "set_up_peak_mib")
                        for a, b in [("nf4 by hand", "bf16 by hand"), ("nf4 lite", "bf16 lite"),
                                     ("bf16 lite", "bf16 by hand"), ("nf4 lite", "nf4 by hand"),
                                     ("nf4 lite built", "nf4 lite")]}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
