"""The set-up model is the model, under every core strategy, against plain PyTorch in one process:

- a method of the user's module (`model.training_step(x, y)`) trains as plain PyTorch does, so it
  ran through DDP's reducer and FSDP's unsharding (with 2 ranks on different data, a method that
  bypassed them would be refused at `backward` or train each rank on half the data);
- `setup(torch.compile(model))` trains as the uncompiled model does, keeps the plain model's
  state dict keys, and its checkpoints load into an uncompiled run and back;
- a tiny Hugging Face GPT-2 (`GPT2LMHeadModel` from a `GPT2Config`, AdamW, transformers' linear
  warm-up) trains as in plain PyTorch, `generate` gives plain PyTorch's tokens, and Lite's
  checkpoint loads into a fresh `GPT2LMHeadModel`;
- where every rank holds the whole model, Hugging Face utilities called on rank 0 alone (no tensor
  in the call: they run on the user's module, outside the strategy's collectives) finish:
  `num_parameters()` after the first step, and `save_pretrained(folder)`, which
  `GPT2LMHeadModel.from_pretrained` reads back as the trained model.

Each strategy is one run of `tests/scripts/set_up_model.py` (all three cases; 2 processes).
DeepSpeed's run is in lite-deepspeed's tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import _set_up_models as models  # noqa: E402

pytest.importorskip("transformers", reason="the test environment installs transformers (hatch.toml)")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

#: Two ranks average their gradients where one process takes the mean over the whole batch: the
#: same numbers, summed in another order (measured: under 1e-7 on these losses).
DISTRIBUTED = 1e-6
#: torch.compile (inductor) fuses and reorders float32 arithmetic, so a compiled run may differ
#: from the eager one in the last bits; on these tiny models it stays far below this.
COMPILE = 1e-5
JOBS = [("single_device", 1), ("ddp", 2), ("ddp_spawn", 2), ("fsdp", 2)]


@pytest.fixture(scope="module")
def plain() -> dict[str, object]:
    losses, regressor = models.plain_regressor()
    gpt2_losses, tokens, gpt2 = models.plain_gpt2()
    return {"losses": losses, "regressor": regressor, "gpt2_losses": gpt2_losses, "tokens": tokens, "gpt2": gpt2,
            "perplexity": models.plain_gpt2_perplexity()}


def close(actual: list[float], expected: list[float], tolerance: float) -> bool:
    return torch.allclose(torch.tensor(actual), torch.tensor(expected), rtol=0, atol=tolerance)


@pytest.mark.parametrize(("strategy", "devices"), JOBS)
def test_training_step_method_trains_as_plain_pytorch(set_up_model_job, plain, strategy, devices):
    record, _ = set_up_model_job(strategy, devices)
    assert close(record["methods"]["losses"], plain["losses"], DISTRIBUTED), (record["methods"], plain["losses"])


@pytest.mark.parametrize(("strategy", "devices"), JOBS)
def test_compiled_model_trains_as_uncompiled_and_keeps_plain_keys(set_up_model_job, plain, strategy, devices):
    record, out_dir = set_up_model_job(strategy, devices)
    compiled = record["compiled"]
    assert compiled["frames_compiled"] > 0, "torch.compile compiled nothing"
    assert close(compiled["losses"], plain["losses"], COMPILE), (compiled["losses"], plain["losses"])
    plain_keys = list(plain["regressor"].state_dict())
    assert compiled["keys"] == plain_keys
    assert compiled["module_is_plain"], "model.module is not the module the user compiled"
    assert list(torch.load(out_dir / "compiled.ckpt", weights_only=True)["model"]) == plain_keys
    # The compiled run's checkpoint loaded into an uncompiled model, and that one's into a compiled one.
    outputs = compiled["outputs"]
    assert outputs["uncompiled"] == outputs["trained"] and outputs["compiled_again"] == outputs["trained"]
    assert close(sum(outputs["trained"], []), plain["regressor"](models.probe()).flatten().tolist(), COMPILE)


@pytest.mark.parametrize(("strategy", "devices"), JOBS)
def test_gpt2_trains_and_generates_as_plain_pytorch(set_up_model_job, plain, strategy, devices):
    record, _ = set_up_model_job(strategy, devices)
    assert close(record["gpt2"]["losses"], plain["gpt2_losses"], DISTRIBUTED), (record["gpt2"], plain["gpt2_losses"])
    assert record["gpt2"]["tokens"] == [plain["tokens"]] * devices  # every rank generated them


@pytest.mark.parametrize(("strategy", "devices"), JOBS)
def test_gpt2_evaluation_with_torchmetrics_equals_one_process(set_up_model_job, plain, strategy, devices):
    record, _ = set_up_model_job(strategy, devices)
    # 11 sequences over 2 processes: each once (a padded shard moves it by about 6e-4 of itself)
    assert abs(record["gpt2"]["perplexity"] / plain["perplexity"] - 1) <= 1e-6, (record["gpt2"], plain["perplexity"])


@pytest.mark.parametrize(("strategy", "devices"), JOBS)
def test_gpt2_checkpoint_loads_into_a_fresh_gpt2(set_up_model_job, plain, strategy, devices):
    from transformers import GPT2LMHeadModel

    _, out_dir = set_up_model_job(strategy, devices)
    fresh = GPT2LMHeadModel(models.gpt2_config())
    fresh.load_state_dict(torch.load(out_dir / "gpt2.ckpt", weights_only=True)["model"])
    fresh.eval()
    assert models.generate(fresh) == plain["tokens"]
    # Logits, not weights: AdamW moves a parameter whose gradient is zero in exact arithmetic (the
    # attention's key bias: softmax ignores a constant shift) by its rounding noise, which no output sees.
    tokens = torch.tensor(plain["tokens"])
    with torch.no_grad():
        assert torch.allclose(fresh(tokens).logits, plain["gpt2"](tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("strategy", "devices"), [job for job in JOBS if job[0] != "fsdp"])
def test_gpt2_utilities_called_on_rank_zero_alone_finish_and_save_the_trained_model(set_up_model_job, plain,
                                                                                     strategy, devices):
    from transformers import GPT2LMHeadModel

    record, out_dir = set_up_model_job(strategy, devices)
    assert record["gpt2"]["parameters"] == plain["gpt2"].num_parameters()
    saved = GPT2LMHeadModel.from_pretrained(out_dir / "gpt2-pretrained")
    checkpoint = torch.load(out_dir / "gpt2.ckpt", weights_only=True)["model"]
    assert all(torch.equal(value, checkpoint[key]) for key, value in saved.state_dict().items())
