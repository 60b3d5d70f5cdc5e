"""LoRA fine-tuning with peft under ZeRO-2 and ZeRO-3 (2 processes), against plain peft in one
process on the same global batches: `tests/scripts/lora_job.py`, the job that
`tests/integration/test_fine_tuning.py` runs under the other strategies.

The adapters-only checkpoint (`trainable_state(model)` with the optimizer) is a DeepSpeed
checkpoint directory without the frozen base (`exclude_frozen_parameters`), the optimizer's
partitions in it: a model with other adapters that loads it and trains the remaining steps ends
with the uninterrupted run's adapters bit for bit, and the other strategies read it whole.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[3] / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
import _lora  # noqa: E402

pytest.importorskip("peft", reason="test-deepspeed installs peft (hatch.toml)")

# A hang guard: a 2-process ZeRO job took 20-70 s here.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

STAGES = ["deepspeed_stage_2", "deepspeed_stage_3"]
#: Two processes average their gradients where one process takes the mean over the whole batch.
DISTRIBUTED = 1e-6
#: AdamW magnifies that last-bit difference where a gradient is near zero (tests/integration/test_fine_tuning.py).
ADAM = 1e-5


@pytest.fixture(scope="module")
def plain() -> dict[str, Any]:
    losses, model = _lora.plain_losses_and_model()
    model.eval()
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        logits = model(input_ids=_lora.probe()).logits
    return {"losses": losses, "adapters": adapters, "logits": logits}


@pytest.fixture(scope="module")
def job(run_script: Any, output_of: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in done:
            out = tmp_path_factory.mktemp(f"lora-{strategy}")
            proc = run_script("lora_job.py", strategy, 2, out, "llama", timeout=400)
            assert proc.returncode == 0, output_of(proc)
            done[strategy] = out
        return done[strategy]

    return run


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = DISTRIBUTED) -> bool:
    return torch.allclose(actual, expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("strategy", STAGES)
def test_lora_under_zero_trains_as_plain_peft(job: Any, plain: dict[str, Any], strategy: str) -> None:
    record = torch.load(job(strategy) / "record.pt", weights_only=True)
    assert close(torch.tensor(record["losses"]), torch.tensor(plain["losses"])), (record["losses"], plain["losses"])
    assert sorted(record["adapters"]) == sorted(plain["adapters"])
    for name, expected in plain["adapters"].items():
        assert close(record["adapters"][name], expected, ADAM), name


@pytest.mark.parametrize("strategy", STAGES)
def test_an_adapters_only_zero_checkpoint_holds_no_base_and_resumes_exactly(
        job: Any, plain: dict[str, Any], strategy: str) -> None:
    out = job(strategy)
    record = torch.load(out / "record.pt", weights_only=True)
    assert record["checkpoint_keys"]["adapters"] == sorted(plain["adapters"])  # read whole, as other strategies do
    assert record["checkpoint_keys"]["optimizer_state"] == len(plain["adapters"])
    assert (out / "checkpoint" / "latest").is_file()  # DeepSpeed's own format
    frozen = [name for name in _lora.base_model().state_dict() if name.endswith("mlp.up_proj.weight")]
    for path in (out / "checkpoint").rglob("*model_states.pt"):
        saved = torch.load(path, map_location="cpu", weights_only=False)["module"]
        assert not any(name.endswith("mlp.up_proj.weight") for name in saved), (path, frozen)
    for name, expected in record["adapters"].items():
        assert torch.equal(record["resumed"][name], expected), name


@pytest.mark.parametrize("strategy", STAGES)
def test_plain_peft_reads_the_adapter_saved_under_zero(job: Any, plain: dict[str, Any], strategy: str) -> None:
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(_lora.base_model(), job(strategy) / "adapter").eval()
    with torch.no_grad():
        assert close(loaded(input_ids=_lora.probe()).logits, plain["logits"])


@pytest.mark.parametrize("strategy", STAGES)
def test_the_adapters_saved_under_zero_load_under_ddp(
        job: Any, run_script: Any, output_of: Any, strategy: str, tmp_path: Path) -> None:
    """Another strategy reads the DeepSpeed directory whole: the adapters and the optimizer."""
    script = tmp_path / "load_adapters.py"
    script.write_text(_LOAD_UNDER_DDP.format(scripts=str(SCRIPTS)))
    checkpoint = job(strategy) / "checkpoint"
    proc = run_script(command=[sys.executable, str(script), str(checkpoint), str(tmp_path / "loaded.pt")], timeout=300)
    assert proc.returncode == 0, output_of(proc)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded["optimizer"] == len(loaded["adapters"])
    step_one = _step_one_adapters()
    for name, expected in step_one.items():
        assert close(loaded["adapters"][name], expected, ADAM), name


_LOAD_UNDER_DDP = """
import sys
sys.path.insert(0, {scripts!r})
import torch, _lora
from lite_core import LightningLite

class Load(LightningLite):
    def run(self):
        model = _lora.lora_model(adapter_seed=99)
        model, optimizer = self.setup(model, _lora.optimizer_for(model))
        self.load(sys.argv[1], {{"adapters": self.trainable_state(model), "optimizer": optimizer}})
        adapters = self.full_state_dict(model, trainable_only=True)
        if self.is_global_zero:
            torch.save({{"adapters": adapters, "optimizer": len(optimizer.state_dict()["state"])}}, sys.argv[2])

Load(accelerator="cpu", strategy="ddp", devices=2).run()
"""


def _step_one_adapters() -> dict[str, torch.Tensor]:
    """Plain peft's adapters after the first step: what the checkpoint (taken there) holds."""
    model = _lora.lora_model()
    optimizer = _lora.optimizer_for(model)
    (tokens,) = _lora.data()[:_lora.GLOBAL_BATCH]
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def test_the_merged_export_under_zero_2_loads_in_transformers(job: Any) -> None:
    """Under ZeRO-2 the weights are whole on every process, so peft merges into them (under ZeRO-3
    the docs merge from the saved adapter on one process, which the peft test above reads)."""
    merged = _lora.model_class().from_pretrained(job("deepspeed_stage_2") / "merged").eval()
    expected = _lora.plain_losses_and_model()[1].merge_and_unload().eval()
    with torch.no_grad():
        assert close(merged(input_ids=_lora.probe()).logits, expected(input_ids=_lora.probe()).logits)
