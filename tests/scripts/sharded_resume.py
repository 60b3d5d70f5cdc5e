"""Save under `fsdp` on 2 processes, resume under another strategy or process count.

    python sharded_resume.py save OUT_DIR
        fsdp, 2 processes: trains STEPS steps and writes the loss of each to
        OUT_DIR/uninterrupted.json; after RESUME_AT steps it saves a sharded checkpoint
        (OUT_DIR/sharded, replacing the one saved a step earlier) and a full one (OUT_DIR/full.pt).
    python sharded_resume.py resume STRATEGY DEVICES CHECKPOINT OUT_JSON
        loads CHECKPOINT into a fresh model and optimizer and trains the remaining steps,
        writing their losses to OUT_JSON.

Every step sees the same 8 samples whatever the process count, so the losses must agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.strategies import FSDPStrategy

torch.set_num_threads(1)

STEPS = 6
RESUME_AT = 3
GLOBAL_BATCH = 8


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    return torch.randn(STEPS * GLOBAL_BATCH, 4, generator=generator), torch.randn(STEPS * GLOBAL_BATCH, 1, generator=generator)


class Train(LightningLite):
    def run(self, mode: str, checkpoint: str, out_json: str) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        if self.strategy.name == "fsdp":
            model = self.setup_module(model)
            optimizer = self.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
        else:
            model, optimizer = self.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        if mode == "resume":
            self.load(checkpoint, state)
            assert state["step"] == RESUME_AT, state["step"]
        loader = self.setup_dataloaders(DataLoader(TensorDataset(*make_data()), batch_size=GLOBAL_BATCH // self.world_size))
        losses = []
        for step, (x, y) in enumerate(loader):
            if step < state["step"]:
                continue
            if mode == "save" and step == RESUME_AT - 1:
                self.save(state, Path(checkpoint, "sharded"))  # an older checkpoint, replaced below
            if mode == "save" and step == RESUME_AT:
                self.save(state, Path(checkpoint, "sharded"))
                self.strategy.state_dict_type = "full"
                self.save(state, Path(checkpoint, "full.pt"))
                self.strategy.state_dict_type = "sharded"
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            self.backward(loss)
            optimizer.step()
            state["step"] = step + 1
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        if self.global_rank == 0:
            Path(out_json).write_text(json.dumps(losses))


def main() -> None:
    if sys.argv[1] == "save":
        out_dir = sys.argv[2]
        lite = Train(accelerator="cpu", strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}), devices=2)
        lite.run("save", out_dir, str(Path(out_dir, "uninterrupted.json")))
        return
    strategy, devices, checkpoint, out_json = sys.argv[2:6]
    if strategy == "fsdp":
        strategy = FSDPStrategy(auto_wrap_policy={nn.Linear})
    Train(accelerator="cpu", strategy=strategy, devices=int(devices)).run("resume", checkpoint, out_json)


if __name__ == "__main__":
    main()
