"""QLoRA on torchao's NF4 (`precision="nf4-torchao"`), which FSDP2 shards: a Llama with peft's
LoRA under `single_device`, `fsdp` and `model_parallel` (FSDP2 per decoder layer; 2 processes), against the same job with the frozen
Linears given NF4 weights by hand and sharded or wrapped by hand at the same world size
(`tests/scripts/nf4_job.py`):

- the losses and the trained adapters equal the hand job's bit for bit (the same NF4 kernels, the
  same `fully_shard` layout, the same per-process batches);
- the adapters-only checkpoint resumes exactly in a model with other adapters;
- the whole checkpoint holds plain tensors, the frozen weights dequantized (what the NF4 weight
  stands for), which one plain process reads without torchao's classes, and which a model set up
  with the precision quantizes again as one process would, shards included.

Under `ddp` it is refused (packages/lite-core/tests/test_quantized.py): DDP's broadcast of the
parameters at setup overwrites an `NF4Tensor`'s statistics, by hand too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import nf4_job  # noqa: E402

pytest.importorskip("peft", reason="the test environment installs peft (hatch.toml)")
pytest.importorskip("torchao", reason="the test environment installs torchao (hatch.toml)")

# A hang guard: a 2-process job took about 30 s here.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

JOBS = [("single_device", 1), ("fsdp", 2), ("model_parallel", 2)]
UP_PROJ = "base_model.model.model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def job(run_script: Any, output_of: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[str, Path] = {}

    def run(strategy: str, devices: int) -> Path:
        if strategy not in done:
            out = tmp_path_factory.mktemp(f"nf4-{strategy}")
            proc = run_script("nf4_job.py", strategy, devices, out, timeout=240)
            assert proc.returncode == 0, output_of(proc)
            done[strategy] = out
        return done[strategy]

    return run


@pytest.mark.parametrize(("strategy", "devices"), JOBS)
def test_nf4_torchao_trains_bitwise_as_torchao_by_hand(job: Any, strategy: str, devices: int) -> None:
    record = torch.load(job(strategy, devices) / "record.pt", weights_only=True)
    assert record["layer"] == "NF4Linear"
    assert record["losses"] == record["hand_losses"]
    assert sorted(record["adapters"]) == sorted(record["hand_adapters"])
    for name, tensor in record["hand_adapters"].items():
        assert torch.equal(record["adapters"][name], tensor), name
    assert all(torch.equal(record["resumed"][name], t) for name, t in record["adapters"].items())


@pytest.mark.parametrize(("strategy", "devices"), JOBS)
def test_the_whole_nf4_checkpoint_holds_plain_dequantized_weights(job: Any, strategy: str, devices: int) -> None:
    from torchao.quantization import to_nf4

    from lite_core import LightningLite

    out = job(strategy, devices)
    record = torch.load(out / "record.pt", weights_only=True)
    assert record["whole_types"] == ["Tensor"]
    original = nf4_job.lora_model().state_dict()[UP_PROJ]
    expected = to_nf4(original).get_original_weight()
    assert torch.equal(record["whole_up_proj"], expected)
    whole = LightningLite(accelerator="cpu").load(out / "whole.ckpt")["model"]  # one plain process, weights_only
    assert torch.equal(whole[UP_PROJ], expected)
    # Loaded into a model built from another base, the weights are quantized again: NF4 of the
    # dequantized weight, as one process quantizes it (under fsdp each shard is cut from the whole
    # weight quantized: shards quantized alone would not share its statistics). Not the first NF4
    # bit for bit: the block scales are quantized again (the docs say so; the exact route is the
    # adapters-only checkpoint over the base's own files).
    assert torch.equal(record["reloaded_up_proj"], to_nf4(expected).get_original_weight())
