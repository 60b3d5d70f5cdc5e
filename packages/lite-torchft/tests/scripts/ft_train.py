"""A user's ordinary loop under `strategy="ddp_ft"` (one replica group; the test starts two).

Usage: python ft_train.py OUT_DIR [split|whole] [plain|fsdp] [trackio] [shuffle|stream] [bucket=URL] [fp8] [linger]

Trains a tiny model over one epoch of a fixed loader, sleeping a little per step so that the test
can kill the group mid-run. Each committed step appends `<step> <life> <sample indices>` to
`OUT_DIR/progress-<group>`; while `OUT_DIR/hold-<group>` exists the group waits between steps, at
once if the file is empty, else once it has committed the step the file names (the test holds the
survivor until the restarted group is ready to join); at the end the weights go to
`OUT_DIR/weights-<group>.pt`, and an evaluation pass over a second loader (under `torch.no_grad()`
and `model.eval()`) writes its summed error and sample count to `OUT_DIR/eval-<group>.pt`. With
`plain`, the same loop runs in plain PyTorch (one process, no Lite) and writes
`OUT_DIR/weights-plain.pt` and `OUT_DIR/eval-plain.pt`. A `ThroughputMonitor` logs a row at each
committed step to a `CSVLogger` in `OUT_DIR/rows/group-<group>/version_<life>/metrics.csv`. With
`trackio`, a `TrackioLogger` (project `ft`, its store in TRACKIO_DIR) also gets, at each committed
step, the loss and the id of the group that logged it. With `bucket=URL` (an `s3://` prefix), the loop
resumes at its top from the latest complete checkpoint under URL (`lite_core.checkpoint.latest`) and
saves `URL/step-<step>` after each committed step, before recording it; a group writes the name of
the checkpoint it resumed from (or nothing) and its step after loading it to
`OUT_DIR/resumed-<group>-<life>` ("step-7 7"), and at the end the
number of times it healed from a peer to `OUT_DIR/heals-<group>`. With `shuffle`, the training loader is the user's shuffled one
(`shuffle=True` with a seeded generator), and `plain(out, shuffle=True)` reads it the same way;
with `stream`, the same rows come from a stream (`RowStream`: an `IterableDataset` with a shuffle
buffer), and `plain(out, stream=True)` reads that. With `fp8`, the model is `fp8_model()` under
`Float8Precision("tensorwise", emulate=True)` (torchao, emulated on the CPU), and each process
writes whether FSDP2 all-gathers its weights in float8 to `OUT_DIR/float8-all-gather-<group>-<rank>`.
A process names itself by its life (`life()`: the test's `LITE_TEST_LIFE`, else its pid) in
these files, and rank 0 writes its pid to `OUT_DIR/pid-<group>-<life>`. With `linger`, the process lives on after `run()` returns, as a Ray worker waiting for its peers
does: it writes `OUT_DIR/finished-<group>` and waits while `OUT_DIR/linger` exists.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

STEPS = 24
BATCH = 4
SLEEP = float(os.environ.get("FT_STEP_SLEEP", "0.25"))


def life() -> int:
    """This process's id in the files the tests read: the test's `LITE_TEST_LIFE` (conftest.py's
    `start_life`), else the pid."""
    return int(os.environ.get("LITE_TEST_LIFE", os.getpid()))


class RowStream(IterableDataset):
    """The rows of a dataset as a stream that knows nothing of ranks or groups, through a shuffle
    buffer of 5 (a seeded `random.Random`)."""

    def __init__(self, rows: TensorDataset) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        rng, pending = random.Random(0), []
        for index in range(len(self.rows)):
            pending.append(index)
            if len(pending) == 5:
                yield self.rows[pending.pop(rng.randrange(len(pending)))]
        rng.shuffle(pending)
        yield from (self.rows[index] for index in pending)


def data(shuffle: bool = False, stream: bool = False) -> DataLoader:
    """The training loader (`shuffle`: the user's shuffled one, its order drawn from its own
    generator; `stream`: the same rows read from a `RowStream`)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 3, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1
    index = torch.arange(len(x), dtype=torch.float64).unsqueeze(1)
    if stream:
        return DataLoader(RowStream(TensorDataset(x, y, index)), batch_size=BATCH)
    order = torch.Generator().manual_seed(3) if shuffle else None
    return DataLoader(TensorDataset(x, y, index), batch_size=BATCH, shuffle=shuffle, generator=order)


def eval_data() -> DataLoader:
    """An evaluation set of 10 samples: 3 batches of 4, the last one short."""
    x = torch.randn(10, 3, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH)


def evaluate(net: torch.nn.Module, loader: DataLoader) -> torch.Tensor:
    """The summed squared error and the number of samples, over the loader."""
    net.eval()
    totals = torch.zeros(2)
    with torch.no_grad():
        for x, y in loader:
            totals += torch.stack([torch.nn.functional.mse_loss(net(x), y, reduction="sum"), torch.tensor(len(x))])
    return totals


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def fp8_model() -> torch.nn.Module:
    """`model()` with two hidden layers FP8 converts (multiples of 16); the first and the head stay."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _float8_all_gather(net: torch.nn.Module) -> bool:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return any(isinstance(getattr(p, "_local_tensor", p), WeightWithDynamicFloat8CastTensor) for p in net.parameters())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor (an FSDP shard gathered)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def plain(out: Path, shuffle: bool = False, stream: bool = False) -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for x, y, _ in data(shuffle, stream):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    torch.save(net.state_dict(), out / "weights-plain.pt")
    torch.save(evaluate(net, eval_data()), out / "eval-plain.pt")


def _held(out: Path, group: str, step: int) -> bool:
    """Whether `OUT_DIR/hold-<group>` exists and is empty or names a step no later than `step`."""
    try:
        text = (out / f"hold-{group}").read_text().strip()
    except FileNotFoundError:
        return False
    return not text or step >= int(text)


def lite(out: Path, split: bool, fsdp: bool, trackio: bool, bucket: str | None, shuffle: bool = False,
         stream: bool = False, fp8: bool = False, linger: bool = False) -> None:
    from lite_core import CSVLogger, Float8Precision, LightningLite, ThroughputMonitor, TrackioLogger
    from lite_core.checkpoint import latest

    group = os.environ["REPLICA_GROUP_ID"]

    class Train(LightningLite):
        def run(self) -> None:
            net = fp8_model() if fp8 else model()
            net, optimizer = self.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
            if fp8:
                (out / f"float8-all-gather-{group}-{self.global_rank}").write_text(str(_float8_all_gather(net)))
            loader, evaluation = self.setup_dataloaders(data(shuffle, stream), eval_data(), split_batches=split)
            monitor = ThroughputMonitor(self, log_every_n_steps=1)  # a row at each committed step
            state = {"model": net, "optimizer": optimizer}  # the strategy adds its step and the loader positions
            if bucket is not None:  # the two lines that resume from the store
                resumed_from = latest(bucket)
                if resumed_from is not None:
                    self.load(resumed_from, state)
                if self.global_rank == 0:
                    name = os.path.basename(resumed_from or "")
                    (out / f"resumed-{group}-{life()}").write_text(f"{name} {self.strategy.step}")
            if self.global_rank == 0:  # its pid, which names what it uploads to the bucket
                (out / f"pid-{group}-{life()}").write_text(str(os.getpid()))
            (out / f"ready-{group}-{life()}").touch()
            while (out / "gate").exists():  # the test opens it once every group is ready (see test_heal.py)
                time.sleep(0.05)
            for x, y, index in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x), y)
                self.backward(loss)
                before = self.strategy.step
                optimizer.step()
                if self.strategy.step > before:  # the step committed: save it (with a bucket), record it at once
                    if bucket is not None:
                        self.save(state, f"{bucket}/step-{self.strategy.step}")
                    rows = " ".join(str(int(i)) for i in index.flatten().tolist())
                    with open(out / f"progress-{group}{'' if self.global_rank == 0 else f'-{self.global_rank}'}", "a") as f:
                        f.write(f"{self.strategy.step} {life()} {rows}\n")
                    monitor.step(batch_size=len(x), step=self.strategy.step)
                    self.log_dict({"loss": loss, "group": float(group)}, step=self.strategy.step)
                time.sleep(SLEEP)  # between steps (a kill lands here, after the record)
                while _held(out, group, self.strategy.step):  # the test holds this group between steps
                    time.sleep(0.05)
            weights = {name: _full(tensor) for name, tensor in net.state_dict().items()}
            # the group evaluates the whole set alone, shared over its processes: summed over them
            totals = self.all_reduce(evaluate(net, evaluation), reduce_op="sum")
            if self.global_rank == 0:
                heals = self.strategy.fault_tolerance_figures()["fault/heals"]
                (out / f"heals-{group}").write_text(str(int(heals)))
                torch.save(weights, out / f"weights-{group}.pt")
                torch.save(totals, out / f"eval-{group}.pt")

    from lite_torchft import DDPFTStrategy
    from lite_torchft.fsdp import FSDPFTStrategy

    rows = CSVLogger(out / "rows", name=f"group-{group}", flush_every=1)  # a row survives a SIGKILL
    loggers = [rows, TrackioLogger(project="ft")] if trackio else [rows]
    precision = Float8Precision("tensorwise", emulate=True) if fp8 else "32-true"
    if fsdp:  # two processes per group, each holding half of every parameter
        Train(accelerator="cpu", devices=2, strategy=FSDPFTStrategy(ft_timeout=5), loggers=loggers,
              precision=precision).run()
    else:
        Train(accelerator="cpu", strategy=DDPFTStrategy(ft_timeout=5), loggers=loggers, precision=precision).run()
    if linger:
        (out / f"finished-{group}").touch()
        while (out / "linger").exists():
            time.sleep(0.05)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    if "plain" in sys.argv[2:]:
        plain(out)
    else:
        buckets = [arg.removeprefix("bucket=") for arg in sys.argv[2:] if arg.startswith("bucket=")]
        lite(out, split="split" in sys.argv[2:], fsdp="fsdp" in sys.argv[2:], trackio="trackio" in sys.argv[2:],
             bucket=buckets[0] if buckets else None, shuffle="shuffle" in sys.argv[2:], stream="stream" in sys.argv[2:],
             fp8="fp8" in sys.argv[2:], linger="linger" in sys.argv[2:])
