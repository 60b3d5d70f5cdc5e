"""Sampler injection and DDP training under a 2-process strategy.

    python train.py STRATEGY OUT_DIR

Writes, per rank, `OUT_DIR/sampling_rank{r}.json` (the sample indexes each set-up dataloader
gave this rank, per epoch), `OUT_DIR/grads_rank{r}.json` (gradient checks during accumulation)
and `OUT_DIR/checks_rank{r}.json` (the errors of training through a model whose setup result was
discarded and of a save that fails on rank 0, and a round trip of LR schedulers through a
checkpoint); rank 0 also writes `OUT_DIR/training.pt` with the data, the initial weights and
the final weights of plain DDP training and of training with gradient accumulation, so that the
test can replay both with a plain one-process PyTorch loop.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from lite_core import LightningLite
from lite_core.plugins import on_writing_ranks

torch.set_num_threads(1)

SAMPLES = 32
FEATURES = 4
GLOBAL_BATCH = 8
MICRO_BATCH = 2  # per rank; 2 micro-batches per optimizer step
LR = 0.1


class RangeDataset(Dataset):
    """Sample `i` is the integer `i`."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class FixedPermutation(Sampler[int]):
    """A user sampler: always the same permutation `(7 * i + 3) % n`."""

    def __init__(self, size: int) -> None:
        self.order = [(7 * i + 3) % size for i in range(size)]

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        return iter(self.order)


class MyLoader(DataLoader):
    """A user's DataLoader subclass whose __init__ takes its own arguments, not DataLoader's."""

    def __init__(self, dataset: Dataset, my_arg: str, batch_size: int) -> None:
        self.my_arg = my_arg
        super().__init__(dataset, batch_size=batch_size, shuffle=False)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.randn(SAMPLES, 1, generator=generator)
    return x, y


class Train(LightningLite):
    def run(self, out_dir: str) -> str:
        self.check_sampling(out_dir)
        self.train_plain()
        self.train_accumulating(out_dir)
        self.check_setup_and_checkpoints(out_dir)
        return json.dumps({"rank": self.global_rank, "pid": os.getpid()})

    # -- sampler injection --------------------------------------------------------------------
    def epochs_of(self, loader, epochs: int = 1) -> dict:
        seen = []
        for _ in range(epochs):
            batches = [batch.tolist() for batch in loader]
            seen.append(batches)
        return {"batches": seen, "len": len(loader), "drop_last": loader.dataloader.drop_last,
                "sampler": [cls.__name__ for cls in type(loader.dataloader.sampler).__mro__]}

    def check_sampling(self, out_dir: str) -> None:
        record = {}
        record["sequential"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(10), batch_size=2, shuffle=False)))
        record["shuffled"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(20), batch_size=5, shuffle=True)), epochs=2)
        record["drop_last"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(11), batch_size=2, drop_last=True)))
        record["keep_last"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(11), batch_size=2, drop_last=False)))
        record["custom_sampler"] = self.epochs_of(
            self.setup_dataloaders(DataLoader(RangeDataset(10), batch_size=2, sampler=FixedPermutation(10))))
        mine = DistributedSampler(RangeDataset(10), num_replicas=2, rank=self.global_rank, shuffle=False)
        loader = self.setup_dataloaders(DataLoader(RangeDataset(10), batch_size=2, sampler=mine))
        record["own_distributed_sampler"] = self.epochs_of(loader)
        record["own_distributed_sampler"]["same_object"] = loader.dataloader.sampler is mine
        loader = self.setup_dataloaders(MyLoader(RangeDataset(10), my_arg="mine", batch_size=2))
        record["custom_loader"] = self.epochs_of(loader)
        record["custom_loader"]["my_arg"] = loader.dataloader.my_arg
        Path(out_dir, f"sampling_rank{self.global_rank}.json").write_text(json.dumps(record))

    # -- training --------------------------------------------------------------------------------
    def fresh(self):
        torch.manual_seed(0)
        model = make_model()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model, optimizer = self.setup(model, optimizer)
        return model, optimizer, initial

    def train_plain(self) -> None:
        model, optimizer, initial = self.fresh()
        x, y = make_data()
        loader = self.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // 2, shuffle=False))
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            self.backward(loss)
            optimizer.step()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gathered = self.all_gather(weights)
        self.results = {"x": x, "y": y, "initial": initial, "plain_final": weights, "plain_steps": len(loader),
                        "plain_ranks_agree": all(torch.equal(g[0], g[1]) for g in gathered.values())}

    def train_accumulating(self, out_dir: str) -> None:
        model, optimizer, initial = self.fresh()
        x, y = make_data()
        loader = self.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=MICRO_BATCH, shuffle=False))
        checks = []
        batches = iter(loader)
        steps = len(loader) // 2
        for _ in range(steps):
            optimizer.zero_grad()
            xb, yb = next(batches)
            with self.no_backward_sync(model):
                self.backward(nn.functional.mse_loss(model(xb), yb))
            unsynced = self.all_gather(model[0].weight.grad.clone())
            xb, yb = next(batches)
            self.backward(nn.functional.mse_loss(model(xb), yb))
            synced = self.all_gather(model[0].weight.grad.clone())
            checks.append({
                "differ_after_no_sync": not torch.allclose(unsynced[0], unsynced[1]),
                "equal_after_sync": torch.equal(synced[0], synced[1]),
            })
            optimizer.step()
        Path(out_dir, f"grads_rank{self.global_rank}.json").write_text(json.dumps(checks))
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gathered = self.all_gather(weights)
        self.results.update(
            accumulated_final=weights,
            accumulated_steps=steps,
            initial_accumulating=initial,
            accumulated_ranks_agree=all(torch.equal(g[0], g[1]) for g in gathered.values()),
        )
        if self.global_rank == 0:
            torch.save(self.results, Path(out_dir, "training.pt"))


    # -- the code users write: discarded setup results, schedulers in checkpoints, failed saves -----
    def check_setup_and_checkpoints(self, out_dir: str) -> None:
        x, y = make_data()
        checks = {"discarded_setup": self.train_without_setup_result(x, y),
                  "forward_called_directly": self.error_of(lambda: self.train_through_forward_directly(x, y))}
        model, optimizer, _ = self.fresh()

        def twice_through_one_forward() -> None:  # legitimate: no error
            with self.no_backward_sync(model):  # DDP reduces once per forward; here it does not reduce
                loss = nn.functional.mse_loss(model(x[:4]), y[:4])
                self.backward(loss, retain_graph=True)
                self.backward(2 * loss)

        checks["retain_graph"] = self.error_of(twice_through_one_forward)
        checks["schedulers"] = self.scheduler_round_trip(out_dir, x, y)
        in_the_way = Path(out_dir, "in_the_way.pt")
        if self.global_rank == 0:
            in_the_way.mkdir()
        self.barrier()
        checks["failed_save"] = self.error_of(lambda: self.save({"model": model}, in_the_way))
        checks["failed_part"] = self.error_of(lambda: on_writing_ranks(
            self.strategy, "parts", lambda: self.write_part(out_dir), writes=True))
        checks["shuffled_resume"] = self.shuffled_resume(out_dir)
        checks["load_then_save"] = self.load_then_save(out_dir)
        Path(out_dir, f"checks_rank{self.global_rank}.json").write_text(json.dumps(checks))

    def shuffled_resume(self, out_dir: str, epochs: int = 3, save_after: int = 2) -> dict:
        """Shuffled training saved at an epoch boundary and resumed (fresh model, loader and
        optimizer, as a restarted script has) against the uninterrupted run."""
        path = Path(out_dir, "shuffled_resume.pt")

        def train(resume: bool) -> list[float]:
            model, optimizer, _ = self.fresh()
            x, y = make_data()
            loader = self.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // 2, shuffle=True))
            state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0}
            if resume:
                self.load(path, state)
            for epoch in range(state["epoch"], epochs):
                for xb, yb in loader:
                    optimizer.zero_grad()
                    self.backward(nn.functional.mse_loss(model(xb), yb))
                    optimizer.step()
                state["epoch"] = epoch + 1
                if not resume and epoch + 1 == save_after:
                    self.save(state, path)
            return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()

        uninterrupted, resumed = train(resume=False), train(resume=True)
        return {"max_difference": max(abs(a - b) for a, b in zip(uninterrupted, resumed))}

    def load_then_save(self, out_dir: str) -> int:
        """The preemption page's resume: load the checkpoint at a path, then save the next step to
        it at once. Rank 1 is late to read (a slow file system): what step does it resume from?"""
        path = Path(out_dir, "load_then_save")
        self.save({"step": 1}, path)
        if self.global_rank == 1:
            time.sleep(0.5)  # makes a save that does not wait for the readers fail; passing needs no delay
        state = {"step": 0}
        self.load(path, state)
        self.save({"step": state["step"] + 1}, path)
        return state["step"]

    def write_part(self, out_dir: str) -> None:
        """A backend's save where each rank writes its part; rank 1's write fails."""
        folder = Path(out_dir, "parts")
        folder.mkdir(exist_ok=True)
        Path(folder, f"part{self.global_rank}").write_text("part")
        if self.global_rank == 1:
            raise OSError(28, "No space left on device")

    def error_of(self, action) -> dict | None:
        try:
            action()
        except Exception as err:
            cause = err.__cause__
            return {"type": type(err).__name__, "message": str(err), "cause": type(cause).__name__ if cause else None}
        return None

    def train_without_setup_result(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """The result is thrown away: `model` is the set-up model all the same, so each rank's
        gradients (from its own half of the batch) are averaged."""
        model = make_model()
        self.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        mine = slice(self.global_rank, None, self.world_size)
        self.backward(nn.functional.mse_loss(model(x[mine]), y[mine]))
        grads = self.all_gather(model[0].weight.grad.clone())
        return {"ranks_agree": torch.equal(grads[0], grads[1])}

    def train_through_forward_directly(self, x: torch.Tensor, y: torch.Tensor) -> None:
        model = make_model()
        self.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        self.backward(nn.functional.mse_loss(model.forward(x), y))  # skips the strategy, as it skips DDP

    def with_schedulers(self) -> dict:
        torch.manual_seed(0)
        model = make_model()
        raw = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}], lr=LR)
        before = torch.optim.lr_scheduler.StepLR(raw, step_size=1, gamma=0.5)  # built on the raw optimizer
        model, optimizer = self.setup(model, raw)
        after = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.9 ** epoch)  # on the set-up one
        return {"model": model, "optimizer": optimizer, "before": before, "after": after, "step": 0}

    def scheduler_round_trip(self, out_dir: str, x: torch.Tensor, y: torch.Tensor) -> dict:
        state = self.with_schedulers()
        for step in range(2):
            state["optimizer"].zero_grad()
            self.backward(nn.functional.mse_loss(state["model"](x), y))
            state["optimizer"].step()
            state["before"].step()
            state["after"].step()
            state["step"] = step + 1
        path = Path(out_dir, "schedulers.pt")
        self.save(state, path)
        fresh = self.with_schedulers()
        self.load(path, fresh)  # weights_only
        saved = torch.load(path, weights_only=True)
        return {
            "step": fresh["step"],
            "before_equal": fresh["before"].state_dict() == state["before"].state_dict(),
            "after_equal": {k: v for k, v in fresh["after"].state_dict().items() if k != "lr_lambdas"}
            == {k: v for k, v in state["after"].state_dict().items() if k != "lr_lambdas"},
            "lrs_equal": [g["lr"] for g in fresh["optimizer"].param_groups]
            == [g["lr"] for g in state["optimizer"].param_groups] != [LR, 0.5],
            "saved_as_state": isinstance(saved["before"], dict) and isinstance(saved["after"], dict),
        }


def main() -> None:
    strategy, out_dir = sys.argv[1], sys.argv[2]
    result = Train(accelerator="cpu", strategy=strategy, devices=2).run(out_dir)
    print(f"RESULT pid={os.getpid()} {result}")


if __name__ == "__main__":
    main()
