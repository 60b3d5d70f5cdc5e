"""Context parallelism (`ModelParallelStrategy(context_parallel_size=2)`) on 4 CPU processes, data 2
x context 2: what runs on a CPU, the loop as a user writes it.

    python context_parallel_job.py OUT_DIR

- `train`: a token model whose attention-free layers work per position (torch's ring attention
  has no CPU kernel) and whose positions come from a non-persistent buffer named in
  `context_parallel_buffers`, trained for 3 SGD steps on sequences the set-up loader cuts in two
  (head-tail). Records the token ids each rank saw per step, the mean loss over the group and the
  final weights, for the test to replay in one plain process; and the warnings of the forward.
- `refusals`: the sentences for an attention call on the CPU, an `attn_mask`, a `parallelize_fn`
  that shards over the data-parallel or the context-parallel ranks alone (gradients left apart),
  and a sequence the group cannot cut into 4 chunks.

Rank 0 writes `OUT_DIR/results.pt`.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from lite_core import LightningLite
from lite_core.strategies import ModelParallelStrategy

torch.set_num_threads(1)

VOCAB, WIDTH, LENGTH, SAMPLES, BATCH, LR = 16, 8, 8, 24, 4, 0.5
DEVICES = 4  # data 2 x context 2


class Tokens(Dataset):
    """Sequences of `LENGTH` token ids; the labels are the next ids."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"ids": self.ids[index, :-1], "labels": self.ids[index, 1:]}


def positions(length: int) -> torch.Tensor:
    angles = torch.arange(length).unsqueeze(1) / 10.0 ** (torch.arange(WIDTH) / WIDTH)
    return torch.sin(angles + math.pi / 4 * (torch.arange(WIDTH) % 2))


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("position", positions(LENGTH), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids) + self.position
        return self.head(hidden + self.mlp(hidden))


class Attention(nn.Module):
    def __init__(self, mask: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, WIDTH // 2)).permute(2, 0, 3, 1, 4)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril() if self.mask else None
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.mask)
        return out.transpose(1, 2).flatten(2)


def shard_over_data_and_context(model: nn.Module, device_mesh: Any) -> nn.Module:
    """The user's parallelize_fn: FSDP2 over data x context, as context parallelism needs."""
    return fully_shard(model, mesh=device_mesh["data_context_parallel"])


def shard_over_data_only(model: nn.Module, device_mesh: Any) -> nn.Module:
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def shard_over_context_only(model: nn.Module, device_mesh: Any) -> nn.Module:
    return fully_shard(model, mesh=device_mesh["context_parallel"])


def strategy(parallelize_fn: Any = shard_over_data_and_context, **kwargs: Any) -> ModelParallelStrategy:
    return ModelParallelStrategy(parallelize_fn, data_parallel_size=2, tensor_parallel_size=1,
                                 context_parallel_size=2, **kwargs)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def train(lite: LightningLite) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TokenModel()
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = lite.setup(model, optimizer)
    loader = lite.setup_dataloaders(DataLoader(Tokens(), batch_size=BATCH))
    seen, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in loader:
            logits = model(batch["ids"])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            optimizer.zero_grad()
            lite.backward(loss)
            optimizer.step()
            seen.append(batch["ids"].clone())
            losses.append(lite.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"initial": initial, "seen": lite.all_gather(torch.stack(seen)), "losses": losses,
            "weights": {name: full(value) for name, value in model.state_dict().items()},
            "position": model.position.clone(), "warnings": [str(w.message) for w in caught]}


def error_of(action: Any) -> str:
    try:
        action()
    except Exception as error:  # the sentence the user reads
        return f"{type(error).__name__}: {error}"
    return "no error"


def forward_of(build: Any, parallelize_fn: Any = shard_over_data_and_context) -> Any:
    def action() -> None:
        lite = LightningLite(accelerator="cpu", devices=DEVICES, strategy=strategy(parallelize_fn))
        lite.launch()
        model = lite.setup(build())
        model(torch.randn(2, LENGTH, WIDTH))
    return action


def refusals() -> dict[str, str]:
    lite = LightningLite(accelerator="cpu", devices=DEVICES, strategy=strategy())
    lite.launch()
    loader = lite.setup_dataloaders(DataLoader([torch.zeros(6, WIDTH)] * 2, batch_size=2))
    return {
        "cpu": error_of(forward_of(lambda: Attention(mask=False))),
        "mask": error_of(forward_of(lambda: Attention(mask=True))),
        "data only": error_of(forward_of(lambda: Attention(mask=False), shard_over_data_only)),
        "context only": error_of(forward_of(lambda: Attention(mask=False), shard_over_context_only)),
        "uneven": error_of(lambda: next(iter(loader))),
    }


def main(out: Path) -> None:
    lite = LightningLite(accelerator="cpu", devices=DEVICES,
                         strategy=strategy(context_parallel_buffers={"position": 0}))
    lite.launch()
    results = {"train": train(lite), "refusals": refusals()}
    results["layout"] = lite.strategy.mesh_layout.sizes()
    results["dim_names"] = lite.strategy.device_mesh.mesh_dim_names
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
