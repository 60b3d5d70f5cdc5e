"""Worker of `cloud_checkpoint.py --sharded`: a sharded checkpoint (`fsdp`, 2 processes) at an
`s3://` URL, Lite against torch distributed checkpoint's `FsspecWriter`/`FsspecReader` by hand,
interleaved, each timed on rank 0 between barriers. Started by `lite run --devices 2` with the S3
client's environment (`AWS_ENDPOINT_URL`, ...) pointing at the parent's server.

    lite run --accelerator cpu --devices 2 _cloud_sharded_worker.py BUCKET MIB REPEATS

Prints one line on rank 0: the medians as `name=seconds` pairs.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from lite_core import LightningLite


def _model(mib: int) -> nn.Module:
    width = 1024
    layers = max(2, (mib << 20) // (4 * width * width))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class ShardedBench(LightningLite):
    def run(self, bucket: str, mib: int, repeats: int) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        raw = _model(mib)
        model = self.setup(raw)  # fully_shard works in place: `raw` holds this rank's shards

        def plain_save(name: str) -> None:
            dcp.save({"model": get_model_state_dict(raw)}, storage_writer=FsspecWriter(f"{bucket}/plain-{name}", sync_files=False))

        def plain_load(name: str) -> None:
            state = {"model": get_model_state_dict(raw)}
            dcp.load(state, storage_reader=FsspecReader(f"{bucket}/plain-{name}"))
            set_model_state_dict(raw, state["model"])

        actions: dict[str, Callable[[str], Any]] = {
            "plain save": plain_save,
            "lite save": lambda name: self.save({"model": model}, f"{bucket}/lite-{name}"),
            "plain load": plain_load,
            "lite load": lambda name: self.load(f"{bucket}/lite-{name}", {"model": model}),
            "stall": lambda name: self.save({"model": model}, f"{bucket}/background-{name}", blocking=False),
        }
        times: dict[str, list[float]] = {name: [] for name in actions}
        for repeat in range(repeats + 1):  # the first round warms up
            for name, action in actions.items():
                seconds = self._timed(action, f"round-{repeat}")
                if repeat:
                    times[name].append(seconds)
            self.wait_for_checkpoint()
        if self.global_rank == 0:
            print(" ".join(f"{name.replace(' ', '_')}={statistics.median(values):.4f}"
                           for name, values in times.items()), flush=True)

    def _timed(self, action: Callable[[str], Any], name: str) -> float:
        dist.barrier()
        started = time.perf_counter()
        action(name)
        seconds = time.perf_counter() - started
        dist.barrier()
        return seconds


if __name__ == "__main__":
    ShardedBench(accelerator="cpu", devices=2, strategy="fsdp").run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
