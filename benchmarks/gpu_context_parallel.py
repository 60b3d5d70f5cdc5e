"""The GPU check's context-parallel cell: `ModelParallelStrategy(context_parallel_size=2)` over NCCL
on 2 ranks, training a small causal transformer (`F.scaled_dot_product_attention(is_causal=True)`,
positions from a named buffer) for a few SGD steps on sequences the set-up loader cuts head-tail,
compared with the same training on whole sequences in one plain PyTorch process.

    python benchmarks/gpu_context_parallel.py --out RESULTS/gpu_context_parallel.json

With one GPU the two ranks share it as two one-process nodes (see `_two_ranks.py`). Exits 0 with
a line saying why on a machine without a GPU (torch has no ring attention kernel for the CPU); 1
when the numbers differ.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _two_ranks import is_node, run_as_nodes, share_a_device, two_ranks  # noqa: E402

VOCAB, WIDTH, HEADS, LENGTH, SAMPLES, BATCH, STEPS, LR = 64, 64, 4, 256, 12, 4, 3, 0.1
#: The ring merges each rank's partial attention in float32 (log-sum-exp): float rounding, not an error.
TOLERANCE = 1e-4


def positions(length: int) -> torch.Tensor:
    angles = torch.arange(length).unsqueeze(1) / 10000.0 ** (torch.arange(WIDTH) / WIDTH)
    return torch.sin(angles + math.pi / 2 * (torch.arange(WIDTH) % 2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, WIDTH // HEADS)).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).flatten(2))
        return x + self.mlp(x)


class CausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("position", positions(LENGTH), persistent=False)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=torch.Generator().manual_seed(1))


def loss_of(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), labels.flatten())


def plain(device: torch.device) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = CausalLM().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = make_data().to(device)
    losses = []
    for step in range(STEPS):
        rows = data[step * BATCH:(step + 1) * BATCH]
        optimizer.zero_grad()
        loss = loss_of(model, rows[:, :-1], rows[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, losses


def lite_run() -> tuple[dict[str, torch.Tensor], list[float]] | None:
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    from lite_core import LightningLite
    from lite_core.strategies import ModelParallelStrategy

    def parallelize(model: nn.Module, device_mesh) -> nn.Module:
        return fully_shard(model, mesh=device_mesh["data_context_parallel"])

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=1, context_parallel_size=2,
                                     context_parallel_buffers={"position": 0})
    lite = LightningLite(accelerator="cuda", strategy=strategy, **two_ranks())
    lite.launch()
    torch.manual_seed(0)
    model = CausalLM()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    rows = make_data()
    loader = lite.setup_dataloaders(DataLoader([(row[:-1], row[1:]) for row in rows][:STEPS * BATCH], batch_size=BATCH))
    losses = []
    for ids, labels in loader:
        optimizer.zero_grad()
        loss = loss_of(model, ids, labels)
        lite.backward(loss)
        optimizer.step()
        losses.append(lite.all_reduce(loss.detach(), reduce_op="mean").item())
    weights = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return (weights, losses) if lite.is_global_zero else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("context parallel: skipped, the ring needs a GPU (torch has no CPU kernel for it) and this machine has none")
        return 0
    if share_a_device("cuda") and not is_node():
        return run_as_nodes([__file__, *sys.argv[1:]])
    torch.backends.cuda.matmul.allow_tf32 = False  # both sides in true float32
    torch.backends.cudnn.allow_tf32 = False
    result = lite_run()
    if result is None:
        return 0
    weights, losses = result
    expected, expected_losses = plain(torch.device("cuda", 0))
    worst = max((weights[k] - expected[k]).abs().max().item() for k in expected)
    loss_gap = max(abs(a - b) for a, b in zip(losses, expected_losses))
    ok = worst < TOLERANCE and loss_gap < TOLERANCE
    summary = {"layout": "dp1 x cp2", "ranks_share_device_0": is_node(), "length": LENGTH, "max_weight_difference_vs_plain": worst,
               "max_loss_difference_vs_plain": loss_gap, "losses": losses, "plain_losses": expected_losses, "ok": ok}
    Path(args.out).write_text(json.dumps(summary, indent=2))
    shared = " (two nodes sharing device 0)" if is_node() else ""
    print(f"context parallel dp1 x cp2{shared}, {LENGTH}-token sequences: max |Lite - plain| weights {worst:.2e}, losses"
          f" {loss_gap:.2e} (tolerance {TOLERANCE:g}): {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
