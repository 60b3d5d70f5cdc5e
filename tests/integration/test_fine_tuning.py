"""LoRA fine-tuning with peft through Lite, a tiny Llama (buffers) and a tiny GPT-2 (a tied head),
under `single_device`, `ddp`, `fsdp` and `model_parallel` (FSDP2, the Llama; 2 processes), against plain peft in one process on the
same global batches (`tests/scripts/lora_job.py`):

- the losses equal plain peft's (fp32, within 1e-6: two processes average their gradients where
  one process takes the mean over the whole batch), and so do the trained adapters (within 1e-5:
  AdamW magnifies that difference where a gradient is near zero, see `ADAM`);
- the adapters-only checkpoint (`trainable_state(model)` with the optimizer) holds the LoRA weights
  alone, and a model with other adapters that loads it and trains the remaining steps ends with
  the uninterrupted run's adapters, bit for bit;
- what rank 0's `save_pretrained(folder, state_dict=full_state_dict(model, trainable_only=True))`
  wrote, plain peft's `PeftModel.from_pretrained` reads in this process, with plain peft's logits;
- the adapters merged into the base (`merge_and_unload()`) and exported with `export_safetensors`
  load in `transformers`' `from_pretrained` with the logits of plain peft's merged model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import _lora  # noqa: E402

pytest.importorskip("peft", reason="the test environment installs peft (hatch.toml)")
pytest.importorskip("safetensors")

# A hang guard: a 2-process job took 40-90 s here (importing transformers and peft on 2 shared cores).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

JOBS = [(strategy, devices, kind) for kind in ("llama", "gpt2")
        for strategy, devices in [("single_device", 1), ("ddp", 2), ("fsdp", 2)]]
# FSDP2 over each decoder block through the user's parallelize_fn: what fsdp checks, one model.
JOBS.append(("model_parallel", 2, "llama"))
#: Two processes average their gradients where one process takes the mean over the whole batch:
#: the same numbers summed in another order.
DISTRIBUTED = 1e-6
#: The trained adapters after AdamW: its first steps move each weight by about the learning rate
#: times its gradient over the gradient's own magnitude, so where a gradient is near zero the
#: summation order's last-bit difference moves the weight by more than it moved the gradient
#: (measured: 2.6e-6 on GPT-2's first lora_B under ddp, 6e-8 on the next layer's; the losses and
#: logits stay within 1e-6).
ADAM = 1e-5


@pytest.fixture(scope="module")
def plains() -> dict[str, dict[str, Any]]:
    return {}


@pytest.fixture
def plain(plains: dict[str, dict[str, Any]], kind: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    # The models this test builds, too; put back afterwards, for the other modules that build
    # `_lora`'s models in this process (they expect its default, a Llama).
    monkeypatch.setattr(_lora, "KIND", kind)
    if kind not in plains:
        plains[kind] = _plain()
    return plains[kind]


def _plain() -> dict[str, Any]:
    losses, model = _lora.plain_losses_and_model()
    model.eval()
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        logits = model(input_ids=_lora.probe()).logits
        merged_logits = model.merge_and_unload()(input_ids=_lora.probe()).logits
    return {"losses": losses, "adapters": adapters, "logits": logits, "merged_logits": merged_logits}


@pytest.fixture(scope="module")
def job(run_script: Any, output_of: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[str, Path] = {}

    def run(strategy: str, devices: int, kind: str) -> Path:
        if (strategy, kind) not in done:
            out = tmp_path_factory.mktemp(f"lora-{kind}-{strategy}")
            proc = run_script("lora_job.py", strategy, devices, out, kind, timeout=240)
            assert proc.returncode == 0, output_of(proc)
            done[strategy, kind] = out
        return done[strategy, kind]

    return run


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = DISTRIBUTED) -> bool:
    return torch.allclose(actual, expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize(("strategy", "devices", "kind"), JOBS)
def test_lora_trains_as_plain_peft(
        job: Any, plain: dict[str, Any], strategy: str, devices: int, kind: str) -> None:
    record = torch.load(job(strategy, devices, kind) / "record.pt", weights_only=True)
    assert close(torch.tensor(record["losses"]), torch.tensor(plain["losses"])), (record["losses"], plain["losses"])
    assert sorted(record["adapters"]) == sorted(plain["adapters"])  # the LoRA weights alone
    for name, expected in plain["adapters"].items():
        assert close(record["adapters"][name], expected, ADAM), name
    moved = max((record["adapters"][n] - _lora.lora_model().state_dict()[n]).abs().max().item() for n in plain["adapters"])
    assert moved > 1e-3, "training barely moved the adapters; the comparison would prove nothing"


@pytest.mark.parametrize(("strategy", "devices", "kind"), JOBS)
def test_an_adapters_only_checkpoint_resumes_exactly(
        job: Any, plain: dict[str, Any], strategy: str, devices: int, kind: str) -> None:
    record = torch.load(job(strategy, devices, kind) / "record.pt", weights_only=True)
    assert record["checkpoint_keys"]["adapters"] == sorted(plain["adapters"])
    assert record["checkpoint_keys"]["optimizer_state"] == len(plain["adapters"])  # AdamW's state of each
    for name, expected in record["adapters"].items():
        assert torch.equal(record["resumed"][name], expected), name


@pytest.mark.parametrize(("strategy", "devices", "kind"), JOBS)
def test_plain_peft_reads_the_saved_adapter_with_plain_pefts_logits(
        job: Any, plain: dict[str, Any], strategy: str, devices: int, kind: str) -> None:
    from peft import PeftModel

    out = job(strategy, devices, kind)
    loaded = PeftModel.from_pretrained(_lora.base_model(), out / "adapter").eval()
    record = torch.load(out / "record.pt", weights_only=True)
    state = loaded.state_dict()
    for name, tensor in record["adapters"].items():
        assert torch.equal(state[name], tensor), name
    with torch.no_grad():
        assert close(loaded(input_ids=_lora.probe()).logits, plain["logits"])


@pytest.mark.parametrize(("strategy", "devices", "kind"), JOBS)
def test_the_merged_export_loads_in_transformers_with_the_merged_logits(
        job: Any, plain: dict[str, Any], strategy: str, devices: int, kind: str) -> None:
    merged = _lora.model_class().from_pretrained(job(strategy, devices, kind) / "merged").eval()
    assert sorted(merged.state_dict()) == sorted(_lora.base_model().state_dict())  # the base's own names
    with torch.no_grad():
        assert close(merged(input_ids=_lora.probe()).logits, plain["merged_logits"])
