"""What a new user trips on when moving a small loop from one process to `fsdp` and back
(`tests/integration/test_new_user_trips.py`).

    python new_user_trips.py fsdp OUT_DIR     # 2 processes, fsdp over gloo
    python new_user_trips.py resume OUT_DIR   # 1 process: resumes what `fsdp` saved

`fsdp`: `measure_flops` of the set-up model (sharded in units of `Block`) against the plain
model's; loading a sharded checkpoint and a plain `torch.save` file into a model with other keys;
a checkpoint of a loader with per-rank batches and one with `split_batches=True`, each taken 2 steps
into the epoch; an epoch under `progress_bar` (stderr is a pipe). Each rank writes
`OUT_DIR/fsdp-rank{R}.json`.

`resume`: loads each loader's checkpoint on one process, recording the warnings that loading and
the resumed epoch raised, and runs that epoch under `progress_bar`; it also loads the plain file
into the other model on one process. Writes `OUT_DIR/resume.json`.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lite_core import LightningLite, measure_flops, progress_bar
from lite_core.errors import CheckpointError
from lite_core.strategies import FSDPStrategy

torch.set_num_threads(1)

BATCH, WIDTH, SAMPLES, PER_RANK_BATCH = 4, 8, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TinyNet(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def other_net() -> nn.Module:
    """Not the model the checkpoints hold: a third block, and the head renamed."""
    model = TinyNet(blocks=3)
    model.out = model.head
    del model.head
    model.forward = lambda x: model.out(x)  # never called
    return model


def expected_flops() -> int:
    """Forward of each Linear: 2 * batch * in * out; a step is 3x the forward, less the first
    Linear's input gradient (the input needs none)."""
    linears = [(WIDTH, 4 * WIDTH), (4 * WIDTH, WIDTH)] * 2 + [(WIDTH, 2)]
    forward = sum(2 * BATCH * i * o for i, o in linears)
    return 3 * forward - 2 * BATCH * WIDTH * 4 * WIDTH


def load_error(lite: LightningLite, path: str, model: nn.Module) -> str:
    try:
        lite.load(path, {"model": model})
    except CheckpointError as error:
        return f"CheckpointError: {error}"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - what the user saw instead (torch's CheckpointException is one)
        return f"{type(error).__name__}: {error}"
    return "no error"


def loaders(lite: LightningLite) -> dict[str, Any]:
    data = list(range(SAMPLES))
    return {"per_rank": lite.setup_dataloaders(DataLoader(data, batch_size=PER_RANK_BATCH, shuffle=True)),
            "split": lite.setup_dataloaders(DataLoader(data, batch_size=2 * PER_RANK_BATCH, shuffle=True),
                                            split_batches=True)}


def fsdp(lite: LightningLite, out: Path) -> None:
    record: dict[str, Any] = {}
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    record["plain_flops"] = measure_flops(TinyNet(), x)
    model = lite.setup(TinyNet())
    try:
        record["set_up_flops"] = measure_flops(model, x)
    except Exception as error:  # noqa: BLE001 - what the user saw instead
        record["set_up_flops"] = f"{type(error).__name__}: {error}"
    record["expected_flops"] = expected_flops()
    model(x).sum().backward()  # the set-up model still trains after being counted
    record["trains_after_counting"] = all(p.grad is not None for p in model.parameters())

    lite.save({"model": model}, out / "sharded")
    record["sharded_into_other"] = load_error(lite, str(out / "sharded"), lite.setup(other_net()))
    if lite.global_rank == 0:
        torch.save({"model": TinyNet().state_dict()}, out / "plain.pt")
    lite.barrier()
    record["file_into_other"] = load_error(lite, str(out / "plain.pt"), lite.setup(other_net()))

    for name, loader in loaders(lite).items():
        for step, _ in enumerate(loader):
            if step == 1:  # 2 steps into the epoch
                lite.save({"loader": loader}, out / f"{name}.ckpt")
                break
    for _ in progress_bar(range(40), lite, desc="fsdp epoch"):
        pass
    (out / f"fsdp-rank{lite.global_rank}.json").write_text(json.dumps(record))


def resume(lite: LightningLite, out: Path) -> None:
    record: dict[str, Any] = {"file_into_other": load_error(lite, str(out / "plain.pt"), lite.setup(other_net()))}
    for name, loader in loaders(lite).items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lite.load(str(out / f"{name}.ckpt"), {"loader": loader})
            batches = sum(1 for _ in progress_bar(loader, lite, desc=f"resumed {name}"))
        record[name] = {"batches": batches, "warnings": [str(w.message) for w in caught],
                        "warned_at": [Path(w.filename).name for w in caught]}
    (out / "resume.json").write_text(json.dumps(record))


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    if mode == "fsdp":
        LightningLite(accelerator="cpu", strategy=FSDPStrategy(auto_wrap_policy={Block}), devices=2).launch(
            fsdp, out_dir)
    else:
        LightningLite(accelerator="cpu", devices=1).launch(resume, out_dir)
