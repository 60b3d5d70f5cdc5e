"""A user's loop over litdata's `StreamingDataset` (`tests/integration/test_litdata.py`).

    python litdata_job.py optimize SAMPLES OUT_DIR              (writes OUT_DIR/data first)
    python litdata_job.py STRATEGY DEVICES OUT_DIR read
    python litdata_job.py STRATEGY DEVICES OUT_DIR first TAG
    python litdata_job.py STRATEGY DEVICES OUT_DIR resume TAG FROM_TAG

`read`: one epoch of `OUT_DIR/data` (items `{"id": i}`) through
`setup_dataloaders(DataLoader(StreamingDataset(...), batch_size=4))`, the dataset made inside
`run()` as a user makes it; each rank writes the ids it was given to `OUT_DIR/read-rank<r>.json`.
`first TAG`: the same through litdata's own `StreamingDataLoader`, 3 batches, then `save` of the
loader to `OUT_DIR/ckpt-TAG` (ids to `TAG-rank<r>.json`); `resume TAG FROM_TAG`: `load` of the
checkpoint `first FROM_TAG` saved, then the rest of the epoch (ids to `TAG-rank<r>.json`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.utils.data import DataLoader

from lite_core import LightningLite


class Read(LightningLite):
    def run(self, out: Path, mode: str, tag: str, source: str = "") -> None:
        from litdata import StreamingDataLoader, StreamingDataset

        dataset = StreamingDataset(f"local:{out / 'data'}")
        if mode == "read":
            loader = self.setup_dataloaders(DataLoader(dataset, batch_size=4))
            ids = [int(i) for batch in loader for i in batch["id"]]
        elif mode == "first":
            loader = self.setup_dataloaders(StreamingDataLoader(dataset, batch_size=4))
            batches = iter(loader)
            ids = [int(i) for _ in range(3) for i in next(batches)["id"]]
            self.save({"loader": loader}, out / f"ckpt-{tag}")
        else:
            loader = self.setup_dataloaders(StreamingDataLoader(dataset, batch_size=4))
            self.load(out / f"ckpt-{source}", {"loader": loader})
            ids = [int(i) for batch in loader for i in batch["id"]]
        (out / f"{tag}-rank{self.global_rank}.json").write_text(json.dumps(ids))


def strategy(name: str) -> object:
    """`model_parallel`: data parallel 2 x tensor parallel 2 (a model-less job: the layout only)."""
    if name != "model_parallel":
        return name
    from lite_core.strategies import ModelParallelStrategy

    return ModelParallelStrategy(lambda model, mesh: model, data_parallel_size=2, tensor_parallel_size=2)


def _item(index: int) -> dict[str, int]:
    return {"id": index}


if __name__ == "__main__" and sys.argv[1] == "optimize":
    from litdata import optimize

    optimize(fn=_item, inputs=list(range(int(sys.argv[2]))), output_dir=str(Path(sys.argv[3]) / "data"),
             chunk_size=8, num_workers=1)
elif __name__ == "__main__":
    mode = sys.argv[4]
    Read(accelerator="cpu", strategy=strategy(sys.argv[1]), devices=int(sys.argv[2])).run(
        Path(sys.argv[3]), mode, sys.argv[5] if len(sys.argv) > 5 else mode, *sys.argv[6:7])
