"""Training under a sharded strategy on 2 processes, for parity with one plain PyTorch process.

    python sharded_train.py STRATEGY OUT_DIR

Rank 0 writes `OUT_DIR/training.pt`: the data, the initial weights, the final full weights of
training with gradient clipping and of training with `no_backward_sync` accumulation, and the
clipping norms. Under `fsdp` it also builds a model with `init_module(empty_init=True)` and
records where its parameters lived and its full weights after setup, and the buffers that a
module built that way wrote in `__init__`, what loading an optimizer without state restored
(`stateless_round_trips`), and what a `full_state_dict` snapshot lost to the next training step
(`snapshot_lost`, `snapshot_unchanged`: `_snapshot.py`); each rank writes
`OUT_DIR/user_collectives_rank{r}.json` with what the collectives of `_user_collectives.py`
returned.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import _snapshot
import _user_collectives
from lite_core import LightningLite
from lite_core.strategies import FSDPStrategy

torch.set_num_threads(1)

SAMPLES = 32
GLOBAL_BATCH = 8
MICRO_BATCH = 2
LR = 0.1
MAX_NORM = 0.3


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(SAMPLES, 4, generator=generator), torch.randn(SAMPLES, 1, generator=generator)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


class Train(LightningLite):
    def run(self, out_dir: str) -> None:
        results = {"x": make_data()[0], "y": make_data()[1]}
        results.update(self.train(accumulate=False))
        results.update(self.train(accumulate=True))
        if self.strategy.name == "fsdp":
            results.update(self.empty_init())
            results.update(self.stateless_optimizer_round_trips(out_dir))
            results["snapshot_lost"], results["snapshot_unchanged"] = _snapshot.taken_before_a_step(self)
            seen = _user_collectives.record(self)
            Path(out_dir, f"user_collectives_rank{self.global_rank}.json").write_text(json.dumps(seen))
        else:
            results.update(self.checkpoint_round_trip(out_dir))
        if self.global_rank == 0:
            torch.save(results, Path(out_dir, "training.pt"))

    def fresh(self, momentum: float = 0.0):
        torch.manual_seed(0)
        model = make_model()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        if self.strategy.name == "fsdp":
            # Set up differently initialised weights, then load the full initial ones into the shards.
            torch.manual_seed(1)
            model = self.setup_module(make_model())
            model.load_state_dict(initial)
            optimizer = self.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum))
        else:
            model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum))
        return model, optimizer, initial

    def train(self, accumulate: bool) -> dict:
        model, optimizer, initial = self.fresh()
        x, y = make_data()
        batch = MICRO_BATCH if accumulate else GLOBAL_BATCH // 2
        batches = iter(self.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=batch)))
        norms, unreduced = [], []
        for _ in range(SAMPLES // GLOBAL_BATCH):
            optimizer.zero_grad()
            if accumulate:
                xb, yb = next(batches)
                with self.no_backward_sync(model):
                    self.backward(nn.functional.mse_loss(model(xb), yb))
                unreduced.append(self.unreduced(model))
            xb, yb = next(batches)
            self.backward(nn.functional.mse_loss(model(xb), yb))
            if not accumulate:
                norms.append(self.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
            optimizer.step()
        name = "accumulated" if accumulate else "clipped"
        return {f"{name}_initial": initial, f"{name}_final": full_weights(model), f"{name}_norms": norms,
                f"{name}_unreduced": unreduced}

    def unreduced(self, model: nn.Module) -> bool:
        """Whether no gradient was communicated yet: `fsdp` hands out a parameter's (sharded)
        gradient only once it was reduced; under sharded DDP the ranks' gradients still differ."""
        if self.strategy.name == "fsdp":
            return all(p.grad is None for p in model.parameters())
        grad = model[0].weight.grad.clone()
        gathered = self.all_gather(grad)
        return not torch.allclose(gathered[0], gathered[1])

    def checkpoint_round_trip(self, out_dir: str) -> dict:
        """Save after a step, load into a fresh model and optimizer; they must step identically."""
        model, optimizer, _ = self.fresh(momentum=0.9)  # momentum: state that must travel
        x, y = make_data()
        steps = []
        for _ in range(2):
            optimizer.zero_grad()
            self.backward(nn.functional.mse_loss(model(x[:4]), y[:4]))
            optimizer.step()
            steps.append(full_weights(model))
        self.save({"model": model, "optimizer": optimizer}, Path(out_dir, "sharded_ddp.pt"))
        optimizer.zero_grad()
        self.backward(nn.functional.mse_loss(model(x[4:8]), y[4:8]))
        optimizer.step()
        expected = full_weights(model)
        model, optimizer, _ = self.fresh(momentum=0.9)
        self.load(Path(out_dir, "sharded_ddp.pt"), {"model": model, "optimizer": optimizer})
        optimizer.zero_grad()
        self.backward(nn.functional.mse_loss(model(x[4:8]), y[4:8]))
        optimizer.step()
        resumed = full_weights(model)
        return {"round_trip_equal": all(torch.equal(expected[k], resumed[k]) for k in expected)}

    def stateless_optimizer_round_trips(self, out_dir: str) -> dict:
        """Save SGD without momentum (no per-parameter state), stepped and before its first step,
        in both formats; load into a fresh model with other weights and an optimizer with another lr."""
        found = {}
        for kind in ("full", "sharded"):
            for stepped in (True, False):
                model, optimizer, _ = self.fresh()
                if stepped:
                    x, y = make_data()
                    self.backward(nn.functional.mse_loss(model(x[:4]), y[:4]))
                    optimizer.step()
                optimizer.param_groups[0]["lr"] = 0.05
                saved = full_weights(model)
                path = Path(out_dir, f"sgd_{kind}_{'stepped' if stepped else 'unstepped'}")
                self.strategy.state_dict_type = kind
                self.save({"model": model, "optimizer": optimizer}, path)
                model, optimizer, _ = self.fresh()
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(1.0)
                self.load(path, {"model": model, "optimizer": optimizer})
                loaded = full_weights(model)
                found[path.name] = {"lr": optimizer.param_groups[0]["lr"], "state": len(optimizer.state),
                                    "weights_equal": all(torch.equal(saved[k], loaded[k]) for k in saved)}
        self.strategy.state_dict_type = "sharded"
        return {"stateless_round_trips": found}

    def empty_init(self) -> dict:
        torch.manual_seed(7)
        with self.init_module(empty_init=True):
            model = make_model()
        on_meta = all(p.is_meta for p in model.parameters())
        model = self.setup_module(model)
        local = {k: v.to_local().numel() for k, v in model.state_dict().items()}
        with self.init_module(empty_init=True):
            masked = Masked()
        masked = self.setup_module(masked)
        buffers = {"mask": masked.mask.clone(), "scale": masked.scale.clone()}
        return {"empty_on_meta": on_meta, "empty_local_numel": local, "empty_final": full_weights(model),
                "empty_buffers": buffers}


class Masked(nn.Module):
    """Buffers written in `__init__` that no `reset_parameters()` recreates."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(n, n)
        self.register_buffer("mask", torch.ones(n, n).tril())
        self.register_buffer("scale", torch.empty(n).fill_(3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.mask[-1] * self.scale


def main() -> None:
    strategy, out_dir = sys.argv[1], sys.argv[2]
    if strategy == "fsdp":
        strategy = FSDPStrategy(auto_wrap_policy={nn.Linear})
    Train(accelerator="cpu", strategy=strategy, devices=2).run(out_dir)


if __name__ == "__main__":
    main()
