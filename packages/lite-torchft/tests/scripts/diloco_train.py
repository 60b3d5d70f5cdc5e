"""A user's ordinary loop under `strategy="diloco"` (one replica group; the test starts two), and
the algorithm simulated in one plain process.

Usage: python diloco_train.py OUT_DIR SYNC_EVERY OUTER_LR OUTER_MOMENTUM FRAGMENTS [local_sgd|fsdp] [delay=TAU]
       [plant=no-outer-heal] [pull=PULL]

(`local_sgd`: `strategy="local_sgd"`, which takes only SYNC_EVERY; its simulation is an outer SGD
at lr 1 without momentum. `fsdp`: `strategy="diloco_fsdp"`, two processes per group, each holding
half of every parameter; the same simulation. Each group also saves a checkpoint after step 6, to
`OUT_DIR/ckpt-<group>`, and after the pass loads it and trains the rest of the pass again: its
weights then go to `OUT_DIR/resumed-<group>.pt`. `pull=PULL`: instead,
`AlgorithmStrategy(PullToAverage(SYNC_EVERY, PULL))`, the algorithm of pull_to_average.py.)

Trains ft_train.py's model over ft_train.py's loader (24 global batches of 4 rows), each group on
its half of every global batch (`split_batches=True`), with ft_train.py's inner SGD; the weights go
to `OUT_DIR/weights-<group>.pt` and the outer steps taken (the Manager's step) to
`OUT_DIR/steps-<group>`. `simulate` computes the same in one process without Lite or torchft.

For the test that kills a group, as ft_train.py does: each inner step appends `<global batch>
<outer steps> <life>` to `OUT_DIR/progress-<group>` (the global batch numbered from 1, read from the
rows' indices), the group waits between steps while `OUT_DIR/hold-<group>` names a global batch it
has reached, sleeps FT_STEP_SLEEP seconds per step (0 by default), and at the end writes the number
of times it healed from a peer to `OUT_DIR/heals-<group>`. `plant=no-outer-heal` plants a fault for that test to see: a group that
heals from a peer keeps its own outer optimizer state.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.functional import mse_loss

from ft_train import BATCH, _full, _held, data, life, model  # the same data, model and inner optimizer as the ddp_ft tests

INNER_LR, INNER_MOMENTUM = 0.05, 0.9
SLEEP = float(os.environ.get("FT_STEP_SLEEP", "0"))


def inner_optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM)


def simulate(sync_every: int, outer_lr: float, outer_momentum: float, groups: int = 2,
             sign: float = 1.0, fragments: int = 1, schedule: list[tuple[int, int]] | None = None,
             delay: int = 0) -> list[dict[str, torch.Tensor]]:
    """DiLoCo in one process: `groups` inner models, each on its slice of every global batch.

    Every `sync_every / fragments` steps one fragment, in turn, synchronises: its pseudo-gradients
    (its weights at its last sync minus each inner model's, times `sign`) are averaged, an outer SGD
    (Nesterov when it has momentum) steps its weights of the last sync, and every inner model takes
    the result for that fragment (keeping its inner optimizer's state). The fragments are the
    model's top-level children in `fragments` consecutive runs. With `delay` (the fragment sync
    delay, tau), the pseudo-gradients are taken `delay` inner steps before the sync that uses them,
    and the fragment's inner steps in between are overwritten by the sync's result. Returns each
    inner model's weights (they differ in the fragments that trained alone since their sync).

    `schedule` (one entry per sync interval, default `(groups, groups)` each) says, for a job that
    lost groups: `(shares, alive)`, the global batch cut into `shares` slices (the groups of the
    last sync) of which the first `alive` groups train on theirs (a dead group's slice is lost) and
    average their pseudo-gradients. A group alive again after an interval away takes group 0's
    inner optimizer state (it healed from it; its weights are the sync's result anyway)."""
    outer_model = model()
    outer = torch.optim.SGD(outer_model.parameters(), lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0)  # a parameter without a gradient is left alone
    inner = [model() for _ in range(groups)]
    optimizers = [inner_optimizer(net) for net in inner]
    children = [name for name, _ in outer_model.named_children()]
    bounds = [round(i * len(children) / fragments) for i in range(fragments + 1)]
    fragment_of = {child: f for f in range(fragments) for child in children[bounds[f]:bounds[f + 1]]}
    interval, syncs, was_alive = sync_every // fragments, 0, groups
    for step, (x, y, _) in enumerate(data(), start=1):
        shares, alive = schedule[syncs] if schedule else (groups, groups)
        for optimizer in optimizers[was_alive:alive]:  # back from a failure: healed from group 0
            optimizer.load_state_dict(copy.deepcopy(optimizers[0].state_dict()))
        was_alive = alive
        for net, optimizer, xs, ys in zip(inner[:alive], optimizers, x.tensor_split(shares), y.tensor_split(shares)):
            optimizer.zero_grad()
            mse_loss(net(xs), ys).backward()
            optimizer.step()
        fragment = syncs % fragments
        names = [name for name, _ in outer_model.named_parameters() if fragment_of[name.split(".")[0]] == fragment]
        weights = dict(outer_model.named_parameters())
        if step % interval == (interval - delay) % interval:  # the fragment's pseudo-gradient, averaged
            with torch.no_grad():
                pending = {name: sign * sum(weights[name] - dict(net.named_parameters())[name]
                                            for net in inner[:alive]) / alive for name in names}
        if step % interval:
            continue
        syncs += 1
        for name in names:
            weights[name].grad = pending[name]
        outer.step()
        outer.zero_grad()
        with torch.no_grad():
            for net in inner:
                local = dict(net.named_parameters())
                for name in names:
                    local[name].copy_(weights[name])
    return [net.state_dict() for net in inner]


def wait_at_the_gate(out: Path, group: str) -> None:
    """Say that this group is set up (its Manager heartbeats to the lighthouse) with
    OUT_DIR/ready-<group>-<life>, and wait while OUT_DIR/gate exists: the test opens it once every
    group is ready, so that no group meets the lighthouse alone because another started later."""
    (out / f"ready-{group}-{life()}").touch()
    while (out / "gate").exists():
        time.sleep(0.05)


def _heal_without_the_outer_optimizer(manager: Any) -> None:
    """A planted fault: this group, healing from a peer, keeps its own outer optimizer state."""
    load = manager._load_state_dict_fns["StreamingDiLoCoFragment_0"]  # torchft 0.2.0's registry
    own = manager._user_state_dicts["StreamingDiLoCoFragment_0"]
    manager._load_state_dict_fns["StreamingDiLoCoFragment_0"] = (
        lambda state: load({**state, "outer_optimizer": own()["outer_optimizer"]}))


def lite(out: Path, sync_every: int, outer_lr: float, outer_momentum: float, fragments: int, local_sgd: bool,
         fsdp: bool, delay: int = 0, plant: str = "", pull: str = "") -> None:
    from lite_core import LightningLite
    from lite_torchft.diloco import DiLoCoFSDPStrategy, DiLoCoStrategy, LocalSGDStrategy

    group = os.environ["REPLICA_GROUP_ID"]

    class Train(LightningLite):
        def run(self) -> None:
            net = model()
            net, optimizer = self.setup(net, inner_optimizer(net))
            if fsdp:  # each process holds a shard of every parameter
                assert all(type(p).__name__ == "DTensor" for p in net.parameters())
            loader = self.setup_dataloaders(data(), split_batches=True)
            if plant == "no-outer-heal":
                _heal_without_the_outer_optimizer(self.strategy.manager)
            wait_at_the_gate(out, group)
            self.train(net, optimizer, loader)
            weights = {name: _full(tensor) for name, tensor in net.state_dict().items()}
            if self.global_rank == 0:
                torch.save(weights, out / f"weights-{group}.pt")
                (out / f"steps-{group}").write_text(str(self.strategy.step))
                (out / f"heals-{group}").write_text(str(int(self.strategy.fault_tolerance_figures()["fault/heals"])))
            if fsdp:  # the pass again from the checkpoint taken after step 6, between the syncs at 4 and 8
                self.load(out / f"ckpt-{group}", {"model": net, "optimizer": optimizer})
                self.train(net, optimizer, loader)
                weights = {name: _full(tensor) for name, tensor in net.state_dict().items()}
                if self.global_rank == 0:
                    torch.save(weights, out / f"resumed-{group}.pt")

        def train(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Any) -> None:
            for x, y, index in loader:
                optimizer.zero_grad()
                self.backward(mse_loss(net(x), y))
                optimizer.step()
                batch = int(index[0]) // BATCH + 1
                if fsdp and batch == 6:
                    self.save({"model": net, "optimizer": optimizer}, out / f"ckpt-{group}")
                if self.global_rank == 0:
                    with open(out / f"progress-{group}", "a") as f:
                        f.write(f"{batch} {self.strategy.step} {life()}\n")
                time.sleep(SLEEP)  # between steps (a kill lands here, after the record)
                while _held(out, group, batch):  # the test holds this group between steps
                    time.sleep(0.05)

    if pull:
        from lite_torchft import AlgorithmStrategy
        from pull_to_average import PullToAverage

        strategy = AlgorithmStrategy(PullToAverage(sync_every, float(pull)), ft_timeout=5)
    elif local_sgd:
        strategy = LocalSGDStrategy(sync_every=sync_every, ft_timeout=5)
    else:
        kind = DiLoCoFSDPStrategy if fsdp else DiLoCoStrategy
        strategy = kind(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, fragments=fragments,
                        fragment_sync_delay=delay, ft_timeout=5)
    Train(accelerator="cpu", devices=2 if fsdp else 1, strategy=strategy).run()


if __name__ == "__main__":
    out, sync_every, outer_lr, outer_momentum, fragments = sys.argv[1:6]
    options = dict(arg.split("=", 1) for arg in sys.argv[6:] if "=" in arg)
    lite(Path(out), int(sync_every), float(outer_lr), float(outer_momentum), int(fragments), "local_sgd" in sys.argv[6:],
         "fsdp" in sys.argv[6:], int(options.get("delay", 0)), options.get("plant", ""),
         options.get("pull", ""))
