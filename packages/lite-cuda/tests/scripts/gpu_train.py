"""Trains a small model on GPUs with Lite; used by the GPU tests.

    python gpu_train.py STRATEGY DEVICES PRECISION OUT_FILE

Prints `PARENT_CUDA_INITIALISED=<bool>` right after constructing `LightningLite` (before any
process starts) and writes, from rank 0, `OUT_FILE` with the data, the initial and final weights,
the device of every rank and whether all ranks ended with equal weights.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite

SAMPLES, FEATURES, GLOBAL_BATCH, LR, EPOCHS = 64, 16, 16, 0.05, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(SAMPLES, FEATURES, generator=generator), torch.randn(SAMPLES, 1, generator=generator)


class Train(LightningLite):
    def run(self, out_file: str) -> str:
        model = make_model()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        x, y = make_data()
        per_rank = GLOBAL_BATCH // self.world_size
        loader = self.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=per_rank, shuffle=False))
        losses = []
        for _ in range(EPOCHS):
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(xb).float(), yb)
                self.backward(loss)
                optimizer.step()
                losses.append(loss.item())
        final = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        gathered = self.all_gather(final)
        devices = self.all_gather(torch.tensor([self.device.index], device=self.device))
        if self.global_rank == 0:
            torch.save({"x": x, "y": y, "initial": initial, "final": {k: v.cpu() for k, v in final.items()},
                        "losses": losses, "devices": devices.flatten().tolist(),
                        "ranks_agree": all(torch.equal(g[0], g[-1]) for g in gathered.values()),
                        "world_size": self.world_size}, out_file)
        return str(self.device)


def main() -> None:
    strategy, devices, precision, out_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    lite = Train(accelerator="cuda", strategy=strategy, devices=devices, precision=precision)
    print(f"PARENT_CUDA_INITIALISED={torch.cuda.is_initialized()}", flush=True)
    print(f"RESULT {lite.run(out_file)}", flush=True)


if __name__ == "__main__":
    main()
