"""One process of the torchft benchmark (benchmarks/torchft_bench.py): a tiny model's steps.

    python _ft_worker.py OUT STRATEGY STEPS SLEEP

Appends `<step> <committed> <time>` to `OUT/steps-<group>-<pid>` after every optimizer step (the
committed step count of the job under ddp_ft, the outer steps under diloco, the step index under
ddp), after `start <time>` (the process began) and `loop <time>` (set-up done).
Under ddp_ft and diloco it writes the seconds of each of the Manager's calls to
`OUT/calls-<group>-<pid>.json`, with `bytes`: the bytes of each tensor handed to its cross-group
all-reduce. STRATEGY `diloco` syncs every FT_SYNC_EVERY inner steps (8 by default). With
FT_STRAGGLE=`P,SECONDS`, each step sleeps SECONDS with probability P (drawn from a generator seeded
by the group id and the pid's life: a straggling machine, independent per group).
STRATEGY `torchft` is the same loop without Lite: torchft's own `Manager`, `DistributedDataParallel`
and `Optimizer` wrapper, written by hand as torchft's examples do (its calls timed the same way).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

START = time.time()


def _loader(steps: int) -> DataLoader:
    x = torch.randn(steps * 8, 32, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _model() -> torch.nn.Module:
    """32 -> FT_HIDDEN (64 by default) -> 1: about 33 * FT_HIDDEN float32 parameters (the state a
    heal transfers; SGD without momentum keeps no optimizer state)."""
    torch.manual_seed(0)
    hidden = int(os.environ.get("FT_HIDDEN", "64"))
    return torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def main(out: Path, strategy: str, steps: int, sleep: float) -> None:
    if strategy == "torchft":
        return plain_torchft(out, steps)
    from lite_core import LightningLite

    group = os.environ.get("REPLICA_GROUP_ID", "ddp")
    loader = _loader(steps)
    straggle = _straggler(group)
    fault_tolerant = strategy in ("ddp_ft", "diloco")

    class Bench(LightningLite):
        def run(self) -> None:
            net = _model()
            net, optimizer = self.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
            calls = _count_calls(self.strategy.manager) if fault_tolerant else {}
            record = out / f"steps-{group}-{os.getpid()}"
            lines = [f"start {START}", f"loop {time.time()}"]  # the first batch opens the first quorum
            for index, (inputs, target) in enumerate(self.setup_dataloaders(loader)):
                optimizer.zero_grad()
                self.backward(torch.nn.functional.mse_loss(net(inputs), target))
                straggle()
                optimizer.step()
                committed = self.strategy.step if fault_tolerant else index + 1
                lines.append(f"{index + 1} {committed} {time.time()}")
                if sleep:
                    record.write_text("\n".join(lines) + "\n")
                    time.sleep(sleep)
            record.write_text("\n".join(lines) + "\n")
            if calls and self.global_rank == 0:
                (out / f"calls-{group}-{os.getpid()}.json").write_text(json.dumps(calls))

    if strategy == "diloco":
        from lite_torchft.diloco import DiLoCoStrategy

        chosen = DiLoCoStrategy(sync_every=int(os.environ.get("FT_SYNC_EVERY", "8")))
    else:
        chosen = strategy
    # the same work per process: ddp_ft and diloco with 2 groups of 1 process, ddp with 2 processes
    Bench(accelerator="cpu", strategy=chosen, devices=1 if fault_tolerant else 2).run()


def _straggler(group: str):
    """What a step waits for on a straggling machine (FT_STRAGGLE): nothing by default."""
    if "FT_STRAGGLE" not in os.environ:
        return lambda: None
    import random

    chance, seconds = (float(v) for v in os.environ["FT_STRAGGLE"].split(","))
    draw = random.Random(f"{group}-{os.environ.get('FT_LIFE', '0')}")
    return lambda: time.sleep(seconds) if draw.random() < chance else None


def plain_torchft(out: Path, steps: int) -> None:
    """The loop on torchft alone: one replica group of one process, the Manager set up as
    ddp_ft sets it up (synchronous quorum, gloo across groups, the same timeouts)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    group = os.environ["REPLICA_GROUP_ID"]
    # the group's store, where the Manager publishes its address (torchrun's agent would hold it)
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False)
    net = _model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=lambda state: (net.load_state_dict(state["model"]),
                                                     optimizer.load_state_dict(state["optim"])),
                      state_dict=lambda: {"model": net.state_dict(), "optim": optimizer.state_dict()},
                      use_async_quorum=False, timeout=timedelta(seconds=10), rank=0, world_size=1,
                      replica_id=f"plain_torchft_{group}")
    calls = _count_calls(manager)
    model, ft_optimizer = DistributedDataParallel(manager, net), Optimizer(manager, optimizer)
    lines = [f"start {START}", f"loop {time.time()}"]
    for index, (inputs, target) in enumerate(_loader(steps)):
        ft_optimizer.zero_grad()  # starts the step's quorum
        torch.nn.functional.mse_loss(model(inputs), target).backward()  # the all-reduce across groups
        ft_optimizer.step()  # the commit vote, then the step
        lines.append(f"{index + 1} {manager.current_step()} {time.time()}")
    (out / f"steps-{group}-{os.getpid()}").write_text("\n".join(lines) + "\n")
    (out / f"calls-{group}-{os.getpid()}.json").write_text(json.dumps(calls))
    manager.shutdown(wait=False)
    del store


def _count_calls(manager) -> dict[str, list[float]]:
    """Time each of the Manager's per-step calls (quorum, all-reduce, commit vote): seconds per
    call, an all-reduce's until its result is there."""
    calls: dict[str, list[float]] = {"start_quorum": [], "allreduce": [], "should_commit": []}
    for name in list(calls):
        original = getattr(manager, name)

        def timed(*args, _name=name, _original=original, **kwargs):
            began = time.perf_counter()
            result = _original(*args, **kwargs)
            if _name == "allreduce":
                result.wait()
            calls[_name].append(time.perf_counter() - began)
            return result

        setattr(manager, name, timed)
    sent: list[float] = []
    allreduce = manager.allreduce

    def counted(tensor, *args, **kwargs):
        sent.append(float(tensor.numel() * tensor.element_size()))
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counted
    return {**calls, "bytes": sent}


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
