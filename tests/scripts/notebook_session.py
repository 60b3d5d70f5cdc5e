"""Code typed into an interactive session: the test feeds it to `python - STRATEGY` on stdin,
so `__main__` has no script file that could be run again.

Prints `RESULT <json>` with what `run()` returned to the session.
"""

import json
import os
import sys

import torch

from lite_core import LightningLite

torch.set_num_threads(1)


class Notebook(LightningLite):
    def run(self, scale):
        total = self.all_reduce(torch.tensor(scale * (self.global_rank + 1.0)), reduce_op="sum")
        gathered = self.all_gather(torch.tensor([os.getpid(), os.getppid()]))
        return {"rank": self.global_rank, "world_size": self.world_size, "total": total.item(),
                "pids": gathered[:, 0].tolist(), "parents": gathered[:, 1].tolist()}


lite = Notebook(accelerator="cpu", strategy=sys.argv[1], devices=2)
result = lite.run(10.0)
print("RESULT " + json.dumps({"session_pid": os.getpid(), "returned": result}))
