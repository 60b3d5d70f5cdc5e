"""Code typed into an interactive session: the test feeds it to `python - STRATEGY [DEVICES]` on
stdin, so `__main__` has no script file that could be run again. STRATEGY `my_ddp` passes an
instance of a user's subclass of `DDPStrategy` (as a backend's DeepSpeed strategy is one).

Prints `RESULT <json>` with what `run()` returned to the session.
"""

import json
import os
import sys

import torch

from lite_core import LightningLite
from lite_core.strategies import DDPStrategy

torch.set_num_threads(1)


class Notebook(LightningLite):
    def run(self, scale):
        total = self.all_reduce(torch.tensor(scale * (self.global_rank + 1.0)), reduce_op="sum")
        gathered = self.all_gather(torch.tensor([os.getpid(), os.getppid()]))
        return {"rank": self.global_rank, "world_size": self.world_size, "total": total.item(),
                "pids": gathered[:, 0].tolist(), "parents": gathered[:, 1].tolist()}


class MyDDP(DDPStrategy):
    name = "my_ddp"


strategy = MyDDP() if sys.argv[1] == "my_ddp" else sys.argv[1]
devices = int(sys.argv[2]) if len(sys.argv) > 2 else 2
lite = Notebook(accelerator="cpu", strategy=strategy, devices=devices)
print("STRATEGY " + type(lite.strategy).__name__, flush=True)
result = lite.run(10.0)
print("RESULT " + json.dumps({"session_pid": os.getpid(), "returned": result}))
