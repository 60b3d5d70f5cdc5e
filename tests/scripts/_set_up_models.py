"""The models, data and plain PyTorch training that `set_up_model.py` runs through Lite and the
tests replay in one process: an MLP with a `training_step` method, the same MLP compiled, and a
tiny Hugging Face GPT-2 built from a config (no download).

Every run uses fixed global batches; under several processes each rank gets its share through
`setup_dataloaders` (DistributedSampler, no shuffling), so one step's global batch is the same
samples in every run and the plain reference trains on it whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

SEED = 7
STEPS = 4
GLOBAL_BATCH = 4
MLP_FEATURES = 4
SEQUENCE = 8
VOCAB = 64
PROMPT = [[3, 14, 15, 9]]
NEW_TOKENS = 5
LR = 0.05


class Regressor(nn.Module):
    """A user's module with its own step method, called as `model.training_step(x, y)`."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(MLP_FEATURES, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self(x), y)


def regressor() -> Regressor:
    torch.manual_seed(SEED)
    return Regressor()


def regressor_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def mlp_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED + 1)
    samples = STEPS * GLOBAL_BATCH
    return TensorDataset(torch.randn(samples, MLP_FEATURES, generator=generator),
                         torch.randn(samples, 1, generator=generator))


def probe() -> torch.Tensor:
    """A fixed input on which two models with the same weights give the same output."""
    return torch.linspace(-1, 1, 3 * MLP_FEATURES).reshape(3, MLP_FEATURES)


def gpt2_config() -> Any:
    from transformers import GPT2Config

    # No dropout: every run (any strategy, the reference) computes the same function.
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=1)


def gpt2() -> Any:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(SEED)
    return GPT2LMHeadModel(gpt2_config())


def gpt2_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED + 2)
    tokens = torch.randint(2, VOCAB, (STEPS * GLOBAL_BATCH, SEQUENCE), generator=generator)
    return TensorDataset(tokens)


#: Evaluation sequences: 11 over 2 processes with batches of 4 do not split evenly (a padded
#: sampler would count one sequence twice, which moves the perplexity by about 6e-4 of itself).
EVAL_SEQUENCES = 11
EVAL_BATCH = 4


def gpt2_eval_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED + 3)
    return TensorDataset(torch.randint(2, VOCAB, (EVAL_SEQUENCES, SEQUENCE), generator=generator))


def perplexity(model: Any, batches: Any, device: Any = "cpu") -> float:
    """torchmetrics' `Perplexity` of next-token predictions over `batches` of `(tokens,)`, as a
    Hugging Face user evaluates a language model (torchmetrics syncs over the processes itself)."""
    from torchmetrics.text import Perplexity

    metric = Perplexity().to(device)
    with torch.no_grad():
        for (tokens,) in batches:
            metric.update(model(input_ids=tokens).logits[:, :-1], tokens[:, 1:])
    return metric.compute().item()


def plain_gpt2_perplexity() -> float:
    """The untrained GPT-2's perplexity over `gpt2_eval_data()` in one plain process."""
    model = gpt2()
    model.eval()
    data = gpt2_eval_data()
    return perplexity(model, [data[i:i + EVAL_BATCH] for i in range(0, EVAL_SEQUENCES, EVAL_BATCH)])


def gpt2_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW and transformers' linear warm-up schedule, as a Hugging Face user writes them."""
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optimizer, get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=STEPS)


def generate(model: Any) -> list[list[int]]:
    """Greedy tokens after `PROMPT` (`model` set up by Lite or plain)."""
    with torch.no_grad():
        tokens = model.generate(torch.tensor(PROMPT), attention_mask=torch.ones(1, len(PROMPT[0]), dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokens.tolist()


# -- the plain PyTorch reference ----------------------------------------------------------------
def _global_batches(dataset: TensorDataset) -> list[tuple[torch.Tensor, ...]]:
    return [dataset[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH] for step in range(STEPS)]


def plain_regressor(compiled: bool = False) -> tuple[list[float], Regressor]:
    """Per-step losses of `Regressor` trained by plain PyTorch, and the trained model."""
    model = regressor()
    optimizer = regressor_optimizer(model)
    call = torch.compile(model) if compiled else model
    losses = []
    for x, y in _global_batches(mlp_data()):
        loss = nn.functional.mse_loss(call(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def plain_gpt2() -> tuple[list[float], list[list[int]], Any]:
    """Per-step losses, greedy tokens after training, and the trained model, in plain PyTorch."""
    model = gpt2()
    optimizer, schedule = gpt2_optimizer(model)
    losses = []
    for (tokens,) in _global_batches(gpt2_data()):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses, generate(model), model
