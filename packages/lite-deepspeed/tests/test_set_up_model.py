"""The set-up model is the model under ZeRO-3 (2 processes), against plain PyTorch in one process:
`model.training_step(x, y)` trains through the engine, `setup(torch.compile(model))` trains as the
uncompiled model with plain keys and checkpoints that load both ways, and a tiny Hugging Face GPT-2
trains, generates plain PyTorch's tokens and converts into a fresh `GPT2LMHeadModel`.

One run of the repository's `tests/scripts/set_up_model.py` (the same run the core strategies get
in tests/integration/test_set_up_model.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "scripts"))
import _set_up_models as models  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("lite_deepspeed") is None or importlib.util.find_spec("deepspeed") is None
        or importlib.util.find_spec("transformers") is None,
        reason="deepspeed and transformers are not installed here: these tests run in `hatch run test-deepspeed:all`",
    ),
    pytest.mark.multiprocess,
    pytest.mark.timeout(560),
]

#: 32-true through DeepSpeed's own partitioned optimizer and reductions.
FLOAT32 = 1e-5
#: inductor fuses and reorders float32 arithmetic; on these tiny models the difference stays below this.
COMPILE = 1e-5


@pytest.fixture(scope="module")
def job(set_up_model_job):
    # Five ZeRO-3 engines (each DeepSpeed start costs 10-25 s here) and a compiled engine.
    return set_up_model_job("deepspeed_stage_3", 2, timeout=500)


@pytest.fixture(scope="module")
def plain():
    losses, regressor = models.plain_regressor()
    gpt2_losses, tokens, gpt2 = models.plain_gpt2()
    return {"losses": losses, "regressor": regressor, "gpt2_losses": gpt2_losses, "tokens": tokens, "gpt2": gpt2,
            "perplexity": models.plain_gpt2_perplexity()}


def close(actual, expected, tolerance):
    return torch.allclose(torch.tensor(actual), torch.tensor(expected), rtol=0, atol=tolerance)


def test_training_step_method_trains_through_the_engine(job, plain):
    record, _ = job
    assert close(record["methods"]["losses"], plain["losses"], FLOAT32), (record["methods"], plain["losses"])


def test_compiled_model_trains_as_uncompiled_with_plain_keys_and_checkpoints_both_ways(job, plain):
    record, _ = job
    compiled = record["compiled"]
    assert compiled["frames_compiled"] > 0, "torch.compile compiled nothing"
    assert close(compiled["losses"], plain["losses"], max(FLOAT32, COMPILE))
    assert compiled["keys"] == list(plain["regressor"].state_dict())
    assert compiled["module_is_plain"]
    outputs = compiled["outputs"]
    assert outputs["uncompiled"] == outputs["trained"] and outputs["compiled_again"] == outputs["trained"]


def test_gpt2_evaluation_with_torchmetrics_equals_one_process(job, plain):
    record, _ = job
    # 11 sequences over 2 processes under ZeRO-3: each once (a padded shard moves it by about 6e-4 of itself)
    assert abs(record["gpt2"]["perplexity"] / plain["perplexity"] - 1) <= FLOAT32, (record["gpt2"], plain["perplexity"])


def test_gpt2_trains_generates_and_converts_into_a_fresh_gpt2(job, plain, tmp_path):
    from transformers import GPT2LMHeadModel

    from lite_deepspeed import convert_to_fp32_state_dict

    record, out_dir = job
    assert close(record["gpt2"]["losses"], plain["gpt2_losses"], FLOAT32), (record["gpt2"], plain["gpt2_losses"])
    assert record["gpt2"]["tokens"] == [plain["tokens"]] * 2
    state = convert_to_fp32_state_dict(out_dir / "gpt2.ckpt", tmp_path / "gpt2.pt")
    fresh = GPT2LMHeadModel(models.gpt2_config())
    fresh.load_state_dict(state)
    fresh.eval()
    assert models.generate(fresh) == plain["tokens"]
    tokens = torch.tensor(plain["tokens"])
    with torch.no_grad():
        assert torch.allclose(fresh(tokens).logits, plain["gpt2"](tokens).logits, rtol=0, atol=FLOAT32)
