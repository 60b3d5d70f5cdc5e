"""The loop a user writes once, run under `fsdp` and `ddp`; checkpoints that move between them.

    python sharded_resume.py save STRATEGY OUT_DIR
        STRATEGY (`fsdp` or `ddp`), 2 processes: trains STEPS steps and writes the loss of each to
        OUT_DIR/uninterrupted.json. Under fsdp, after RESUME_AT steps it saves a sharded checkpoint
        (OUT_DIR/sharded, replacing the one saved a step earlier) and a full one (OUT_DIR/full.pt);
        before the first step too, as a loop that saves every N steps does (OUT_DIR/step0_sharded,
        OUT_DIR/step0_full.pt): saving must not change the training that follows.
    python sharded_resume.py resume STRATEGY DEVICES CHECKPOINT OUT_JSON [AT]
        loads CHECKPOINT (saved after AT steps, RESUME_AT by default) into a fresh model, optimizer
        and LR scheduler and trains the remaining steps, writing their losses to OUT_JSON.

The optimizer has two param groups with different learning rates and an LR scheduler built on it
before `setup(model, optimizer)`, exactly as under ddp. Resuming under fsdp with 2 processes sets
up the other way (`setup_module`, then the optimizer and scheduler from the sharded model), so a
checkpoint written one way is loaded the other. Every step sees the same 8 samples whatever the
process count, so the losses must agree.
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


def param_groups(model: nn.Module) -> list[dict]:
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}]


class Train(LightningLite):
    def build(self, style: str):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        if style == "setup_module":  # fsdp's other way: the optimizer from the sharded model
            model = self.setup_module(model)
            optimizer = self.setup_optimizers(torch.optim.AdamW(param_groups(model), lr=0.05))
            return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        optimizer = torch.optim.AdamW(param_groups(model), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)  # before setup
        model, optimizer = self.setup(model, optimizer)
        return model, optimizer, scheduler

    def run(self, mode: str, checkpoint: str, out_json: str, at: int = RESUME_AT) -> None:
        other_way = mode == "resume" and self.strategy.name == "fsdp" and self.world_size == 2
        style = "setup_module" if other_way else "setup"
        model, optimizer, scheduler = self.build(style)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
        if mode == "resume":
            self.load(checkpoint, state)
            assert state["step"] == at, state["step"]
            assert scheduler.last_epoch == at, scheduler.last_epoch
        loader = self.setup_dataloaders(DataLoader(TensorDataset(*make_data()), batch_size=GLOBAL_BATCH // self.world_size))
        losses = []
        for step, (x, y) in enumerate(loader):
            if step < state["step"]:
                continue
            saving = mode == "save" and self.strategy.name == "fsdp"
            if saving and step == 0:
                self.save_both(state, checkpoint, "step0_sharded", "step0_full.pt")
            if saving and step == RESUME_AT - 1:
                self.save(state, Path(checkpoint, "sharded"))  # an older checkpoint, replaced below
            if saving and step == RESUME_AT:
                self.save_both(state, checkpoint, "sharded", "full.pt")
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            self.backward(loss)
            optimizer.step()
            scheduler.step()
            state["step"] = step + 1
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        if self.global_rank == 0:
            Path(out_json).write_text(json.dumps(losses))
        if mode == "save" and self.strategy.name == "fsdp":
            self.fail_to_save(state, Path(checkpoint))

    def save_both(self, state: dict, checkpoint: str, sharded: str, full: str) -> None:
        self.save(state, Path(checkpoint, sharded))
        self.strategy.state_dict_type = "full"
        self.save(state, Path(checkpoint, full))
        self.strategy.state_dict_type = "sharded"

    def fail_to_save(self, state: dict, out_dir: Path) -> None:
        """Saving under a path whose parent is a file fails on rank 0: every rank must raise."""
        blocker = out_dir / "a_file"
        if self.global_rank == 0:
            blocker.write_text("in the way")
        self.barrier()
        errors = {}
        for kind in ("sharded", "full"):
            self.strategy.state_dict_type = kind
            try:
                self.save(state, blocker / "ckpt")
            except Exception as err:
                errors[kind] = {"type": type(err).__name__, "message": str(err),
                                "cause": type(err.__cause__).__name__ if err.__cause__ else None}
        self.strategy.state_dict_type = "sharded"
        Path(out_dir, f"failed_saves_rank{self.global_rank}.json").write_text(json.dumps(errors))
        self.barrier()
        if self.global_rank == 0:
            blocker.unlink()


def main() -> None:
    if sys.argv[1] == "save":
        strategy, out_dir = sys.argv[2:4]
        if strategy == "fsdp":
            strategy = FSDPStrategy(auto_wrap_policy={nn.Linear})
        lite = Train(accelerator="cpu", strategy=strategy, devices=2)
        lite.run("save", out_dir, str(Path(out_dir, "uninterrupted.json")))
        return
    strategy, devices, checkpoint, out_json = sys.argv[2:6]
    at = int(sys.argv[6]) if len(sys.argv) > 6 else RESUME_AT
    if strategy == "fsdp":
        strategy = FSDPStrategy(auto_wrap_policy={nn.Linear})
    Train(accelerator="cpu", strategy=strategy, devices=int(devices)).run("resume", checkpoint, out_json, at)


if __name__ == "__main__":
    main()
