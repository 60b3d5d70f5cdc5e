"""A user's own values sharded like the model (an average of its parameters, kept as a plain dict of
the set-up model's `DTensor`s) in `save` content under `fsdp` on 2 processes:

    python dtensor_content.py OUT_DIR

Saves `{"model", "ema", "history", "step"}` sharded, wipes the averages, loads them back under
`fsdp` (into the same `DTensor`s), then reads the checkpoint under `ddp` (into whole tensors) and
whole with `load(path)`; then saves new averages with `state_dict_type="full"` and reads that one file
with `torch.load`. Every rank writes `OUT_DIR/rank<r>.pt`: the full averages saved, and what each
load gave back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lite_core import LightningLite
from lite_core.strategies import FSDPStrategy

torch.set_num_threads(1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def main(out: Path) -> None:
    lite = LightningLite(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    lite.launch()
    model = lite.setup(make_model())
    # The user's average of the weights, as a plain dict: under fsdp each value is a DTensor shard.
    ema = {name: 2 * p.detach().clone() + 1 for name, p in model.named_parameters()}
    history = [ema["0.weight"] * 3]
    saved = {name: full(value) for name, value in ema.items()}
    saved_history = full(history[0])
    lite.save({"model": model, "ema": ema, "history": history, "step": 7}, out / "ckpt")

    for value in [*ema.values(), *history]:
        value.zero_()
    state = {"model": model, "ema": ema, "history": history, "step": 0}
    lite.load(out / "ckpt", state)
    loaded = {name: full(value) for name, value in ema.items()}
    kept_objects = all(state["ema"][name] is ema[name] for name in ema)

    whole = lite.load(out / "ckpt")  # no state: the content, read whole

    ddp = LightningLite(accelerator="cpu", devices=2, strategy="ddp")
    ddp.launch()
    plain = ddp.setup(make_model())
    under_ddp = {"model": plain, "ema": {name: torch.zeros_like(p) for name, p in plain.named_parameters()},
                 "history": [torch.zeros(8, 6)]}
    ddp.load(out / "ckpt", under_ddp)  # plain values are replaced by what was saved, read whole

    # A full checkpoint is one file that a plain process reads: the averages in it are whole.
    one_file = LightningLite(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type="full"))
    one_file.launch()
    again = one_file.setup(make_model())
    averages = {name: 2 * p.detach().clone() + 1 for name, p in again.named_parameters()}
    one_file.save({"model": again, "ema": averages}, out / "full.pt")
    one_file.save({"model": again, "ema": averages}, out / "full-background.pt", blocking=False)
    one_file.wait_for_checkpoint()
    dist.barrier()
    # a DTensor would be refused by weights_only
    in_the_file = {which: torch.load(out / f"{which}.pt", weights_only=True)["ema"] for which in ("full", "full-background")}

    torch.save({"saved": saved, "saved_history": saved_history, "loaded": loaded, "step": state["step"],
                "loaded_history": full(history[0]), "kept_objects": kept_objects,
                "whole": {name: full(whole["ema"][name]) for name in ema}, "whole_step": whole["step"],
                "under_ddp": {name: full(value) for name, value in under_ddp["ema"].items()},
                "under_ddp_history": full(under_ddp["history"][0]),
                "in_one_file": {which: {name: (type(value).__name__, value) for name, value in ema.items()}
                                for which, ema in in_the_file.items()}},
               out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
