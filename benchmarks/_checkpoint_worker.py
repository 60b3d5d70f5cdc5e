"""Worker: `save`/`load` of a 200 MB state, Lite vs plain torch, and the training stall of a
background save, interleaved in one process. Before each timed repetition the page cache's
dirty pages are written out (`os.sync()`, not timed), so that no arm is slowed by the disk
write an earlier arm left behind.

    python _checkpoint_worker.py --reps N --out FILE

The state is a 6x Linear(2048,2048) model (25.2M float32 parameters, 100.7 MB) and its SGD
momentum (another 100.7 MB), after one step. Each repetition, in rotating order:

* save:  `torch.save({"model": m.state_dict(), "optimizer": o.state_dict()}, path)` (plain, and
  again as the A/A control) vs `lite.save({"model": m, "optimizer": o}, path)` (atomic: a
  temporary file, fsync, rename);
* load:  `torch.load(path)` + `model.load_state_dict` + `optimizer.load_state_dict` vs
  `lite.load(path, {"model": m, "optimizer": o})`, from the file each arm wrote;
* stall: how long the training loop is held by `lite.save(...)` (blocking) vs
  `lite.save(..., blocking=False)` (the copy to host memory); the background write is waited
  for outside the timed part.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import torch
from torch import nn

from _common import write_json


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    return model, optimizer


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lite_core import LightningLite

    plain_model, plain_opt = build()
    lite = LightningLite(accelerator="cpu")
    lite_model, lite_opt = lite.setup(*build())
    paths = {arm: os.path.join(args.dir, f"{arm}.pt") for arm in ("plain", "lite", "control")}
    state = lambda: {"model": lite_model, "optimizer": lite_opt}  # noqa: E731

    def plain_save(path: str) -> Callable[[], None]:
        return lambda: torch.save({"model": plain_model.state_dict(), "optimizer": plain_opt.state_dict()}, path)

    def plain_load(path: str) -> Callable[[], None]:
        def load() -> None:
            content = torch.load(path)
            plain_model.load_state_dict(content["model"])
            plain_opt.load_state_dict(content["optimizer"])
        return load

    def background_save() -> None:
        lite.save(state(), paths["lite"], blocking=False)

    rows: dict[str, dict[str, Callable[[], None]]] = {
        "save": {"plain": plain_save(paths["plain"]), "lite": lambda: lite.save(state(), paths["lite"]),
                 "control": plain_save(paths["control"])},
        "load": {"plain": plain_load(paths["plain"]), "lite": lambda: lite.load(paths["lite"], state()),
                 "control": plain_load(paths["control"])},
        "stall": {"plain": lambda: lite.save(state(), paths["lite"]), "lite": background_save},
    }
    results: dict[str, dict[str, list[float]]] = {name: {arm: [] for arm in arms} for name, arms in rows.items()}
    for name, arms in rows.items():
        for fn in arms.values():  # warm-up: files exist, pages cached, lazy imports done
            fn()
            lite.wait_for_checkpoint()
        order = list(arms)
        for rep in range(args.reps):
            shift = rep % len(order)
            for arm in order[shift:] + order[:shift]:
                os.sync()  # no arm pays for the disk write another arm left in the page cache
                results[name][arm].append(timed(arms[arm]))
                lite.wait_for_checkpoint()
    megabytes = os.path.getsize(paths["lite"]) / 1e6
    write_json(args.out, {"reps": args.reps, "megabytes": megabytes, "seconds": results})


if __name__ == "__main__":
    main()
