"""A method is a forward pass only when it is one: rank 0 alone calls
`model.save_pretrained(folder, state_dict=full)` on the set-up peft model under `ddp` (a tiny
Llama, whose rotary buffers DDP broadcasts in each forward) and `fsdp` (2 processes each), and
the call returns instead of waiting in a collective that rank 1 never joins; plain peft's
`PeftModel.from_pretrained` reads what it wrote as the trained model (`tests/scripts/rank_zero_method.py`).
Routed as a forward pass (the old rule: any tensor among the arguments), the job dies at the
collective timeout (20 s in the tests) or runs into this test's timeout.
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

# A hang guard: a job took 40-90 s here (2 processes importing transformers and peft on 2 shared cores).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rank_zero_save_pretrained_with_a_state_dict_returns_and_plain_peft_reads_it(
        run_script: Any, output_of: Any, tmp_path: Path, strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import PeftModel

    monkeypatch.setattr(_lora, "KIND", "llama")  # the script's model, whatever another module set before

    proc = run_script("rank_zero_method.py", strategy, tmp_path, timeout=200)
    assert proc.returncode == 0, output_of(proc)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    loaded = PeftModel.from_pretrained(_lora.base_model(), tmp_path / "adapter").eval()
    state = loaded.state_dict()
    assert sorted(state) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(state[name], tensor), name
    trained = _lora.lora_model().eval()
    trained.load_state_dict(full)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_lora.probe()).logits, trained(input_ids=_lora.probe()).logits)
