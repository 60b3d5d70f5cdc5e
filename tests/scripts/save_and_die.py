"""A 2-process `ddp` job whose rank 0 is killed (SIGKILL) in the middle of its second `save`.

    python save_and_die.py CHECKPOINT [background]

Both ranks train one step and save `{"version": 1, "model": ..., "optimizer": ...}` to
CHECKPOINT; rank 0 writes the expected weights to CHECKPOINT.expected.pt (plain torch.save).
They then train another step and save version 2, but rank 0's write dies half way: `torch.save`
writes part of the bytes, flushes them, and the process SIGKILLs itself. With `background`, the
second save is `save(..., blocking=False)`: rank 0 dies in its background writer thread.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

from lite_core import LightningLite

torch.set_num_threads(1)


def dying_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
    f.write(b"PK\x03\x04 half a checkpoint")  # type: ignore[attr-defined]
    f.flush()  # type: ignore[attr-defined]
    os.kill(os.getpid(), signal.SIGKILL)


class SaveAndDie(LightningLite):
    def run(self, path: str, background: bool) -> None:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        model, optimizer = self.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for version in (1, 2):
            optimizer.zero_grad()
            self.backward(model(torch.randn(8, 4)).pow(2).mean())
            optimizer.step()
            if version == 2 and self.global_rank == 0:
                torch.save = dying_save
            content = {"version": version, "model": model, "optimizer": optimizer}
            self.save(content, path, blocking=not (background and version == 2))
            if version == 1 and self.global_rank == 0:
                torch.save(model.state_dict(), path + ".expected.pt")
        self.wait_for_checkpoint()
        print("UNEXPECTED: the second save returned")


if __name__ == "__main__":
    SaveAndDie(accelerator="cpu", strategy="ddp", devices=2).run(sys.argv[1], sys.argv[2:] == ["background"])
