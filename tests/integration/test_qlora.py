"""QLoRA through Lite: `QuantizedPrecision` on a tiny Llama with peft's LoRA adapters, against the
same job with bitsandbytes applied by hand (`tests/scripts/_qlora.py`) at the same world size
(`tests/scripts/qlora_job.py`):

- one process (`single_device`, run in this process) in every mode, and two `ddp` processes over
  gloo (the hand model in torch's `DistributedDataParallel`, on the very batches each process got):
  the losses, the trained adapters and the quantized base equal the hand job's bit for bit. The
  same layers, the same bitsandbytes kernels, the same per-process batches and the same two-term
  gradient all-reduce: no step adds numbers in another order, so nothing needs a tolerance;
- two processes against one: within 1e-5 (each process averages the gradient of its half batch
  before the all-reduce averages the two, where one process takes the mean over the whole batch:
  the same numbers summed in another order; AdamW magnifies that last bit where a gradient is near
  zero, as in test_fine_tuning.py);
- the adapters-only checkpoint holds the LoRA weights alone, the whole one the quantized base with
  bitsandbytes' statistics, and a fresh model (other adapters; for the whole checkpoint another
  base too) that loads either one and trains the remaining steps ends with the uninterrupted run's
  adapters, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import _lora  # noqa: E402
import _qlora  # noqa: E402

pytest.importorskip("peft", reason="the test environment installs peft (hatch.toml)")
pytest.importorskip("bitsandbytes", reason="the test environment installs bitsandbytes (hatch.toml)")

#: Two processes against one: the summation order of the split batch, magnified by AdamW (see above).
ADAM = 1e-5


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import qlora_job

    done: dict[str, dict[str, Any]] = {}

    def run(mode: str, built: bool = False) -> dict[str, Any]:
        key = f"{mode}-built" if built else mode
        if key not in done:
            _lora.KIND = "llama"
            out = tmp_path_factory.mktemp(f"qlora-{key}")
            lite = qlora_job.QLoRA(accelerator="cpu", precision=qlora_job.precision_for(mode))
            done[key] = lite.run(str(out), mode, built=built)
        return done[key]

    return run


def assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def assert_as_by_hand(record: dict[str, Any]) -> None:
    assert record["losses"] == record["hand_losses"]
    assert_equal(record["adapters"], record["hand_adapters"])
    assert len(record["hand_base"]) > 0
    assert_equal(record["base"], record["hand_base"])  # the same layers, quantized to the same bytes
    moved = max((record["adapters"][n] - _lora.lora_model().state_dict()[n]).abs().max().item()
                for n in record["adapters"])
    assert moved > 1e-3, "training barely moved the adapters; the comparison would prove nothing"


def assert_resumes_exactly(record: dict[str, Any]) -> None:
    lora = sorted(record["hand_adapters"])
    assert record["adapters_keys"] == lora  # the adapters alone
    assert set(lora) | set(record["base"]) <= set(record["whole_keys"])  # the quantized base with its statistics
    assert any(key.endswith(".weight.absmax") or key.endswith(".SCB") for key in record["whole_keys"])
    assert_equal(record["resumed_adapters"], record["adapters"])
    assert_equal(record["resumed_whole"], record["adapters"])


@pytest.mark.parametrize("mode", sorted(_qlora.MODES))
def test_one_process_trains_bitwise_as_bitsandbytes_by_hand(one_process: Any, mode: str) -> None:
    assert_as_by_hand(one_process(mode))


@pytest.mark.parametrize("mode", sorted(_qlora.MODES))
def test_adapters_only_and_whole_quantized_checkpoints_resume_exactly(one_process: Any, mode: str) -> None:
    assert_resumes_exactly(one_process(mode))


FOUR_BIT = sorted(mode for mode in _qlora.MODES if mode != "int8")


@pytest.mark.parametrize("mode", FOUR_BIT)
def test_a_base_built_4_bit_under_empty_init_trains_bitwise_as_bitsandbytes_by_hand(one_process: Any, mode: str) -> None:
    """Built inside `init_module(empty_init=True)`, the base's layers are 4-bit as they leave the
    block (never whole in full precision), take the full-precision weights loaded afterwards
    quantized, and train, save and resume as the base quantized by hand before peft wrapped it."""
    record = one_process(mode, built=True)
    assert record["layers_as_built"] == ["Linear4bit"]
    assert_as_by_hand(record)
    assert_resumes_exactly(record)


@pytest.fixture(scope="module")
def two_processes(run_script: Any, output_of: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("qlora-ddp")
    proc = run_script("qlora_job.py", "ddp", 2, out, "nf4-dq", timeout=240)
    assert proc.returncode == 0, output_of(proc)
    return torch.load(out / "record.pt", weights_only=True)


# A hang guard: the 2-process job took about 40 s here (importing transformers and peft on 2 shared cores).
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ddp_trains_bitwise_as_bitsandbytes_by_hand_under_torch_ddp(two_processes: dict[str, Any]) -> None:
    assert_as_by_hand(two_processes)
    assert_resumes_exactly(two_processes)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ddp_trains_a_base_built_4_bit_under_empty_init_bitwise_as_by_hand(
        run_script: Any, output_of: Any, tmp_path: Path) -> None:
    """Each process builds the 4-bit base and loads the weights; DDP then broadcasts rank 0's."""
    proc = run_script("qlora_job.py", "ddp", 2, tmp_path, "nf4-dq", "built", timeout=240)
    assert proc.returncode == 0, output_of(proc)
    record = torch.load(tmp_path / "record.pt", weights_only=True)
    assert record["layers_as_built"] == ["Linear4bit"]
    assert_as_by_hand(record)
    assert_resumes_exactly(record)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ddp_follows_one_process_within_the_summation_order(two_processes: dict[str, Any], one_process: Any) -> None:
    one = one_process("nf4-dq")
    assert torch.allclose(torch.tensor(two_processes["losses"]), torch.tensor(one["losses"]), rtol=0, atol=1e-6)
    for name, expected in one["adapters"].items():
        assert torch.allclose(two_processes["adapters"][name], expected, rtol=0, atol=ADAM), name
