"""The set-up loader's global position: what its bookkeeping costs per batch, and how fast `load`
reaches a position deep in an epoch (`run.py --only loader_position`).

1. Per batch: a plain shuffled `DataLoader` over a `TensorDataset` vs the same loader set up by
   Lite on one process (`EpochOrder` sampler, a consumed-batch count), iterated without a model,
   in interleaved blocks; and the Python calls per batch of each (deterministic).
2. Deep resume: a 1M-sample shuffled epoch with `num_workers=2`. The Lite arm loads a position
   90% into it and takes its first batch; the plain arm takes the first batch of a fresh epoch
   (what any start pays: workers, the shuffle). Also timed: plain PyTorch reaching the same
   sample by iterating (fetching) the batches before it, on a 10% slice, scaled.
3. Per batch of a stream: a plain `DataLoader` over an `IterableDataset` of tensors vs the same
   loader set up by Lite on one process (`GlobalStream`: cut into rounds, the consumed samples
   counted), as in 1.
4. Deep resume of a stream: a 1M-sample stream, `num_workers=2`, a position loaded 90% into it and
   its first batch, for a stream that can seek (`lite_iter_from`) and one that cannot (read and
   dropped), vs a fresh pass's first batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_json  # noqa: E402

BATCH = 32


class Cheap(Dataset):
    """`size` samples that cost nothing to build: the deep resume times only the skip."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class Rows(IterableDataset):
    """The rows of `data`, streamed (what a reader of shards yields, without the reading)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.data)


class Counting(IterableDataset):
    """`size` samples that cost nothing to build; `seek` gives it `lite_iter_from`."""

    def __init__(self, size: int, seek: bool) -> None:
        self.size, self.seek = size, seek

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.size))

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "lite_iter_from" and self.__dict__.get("seek"):
            return lambda start: iter(range(start, self.size))
        raise AttributeError(name)


def stream_resume(samples: int, reps: int) -> dict[str, object]:
    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu")
    consumed = samples * 9 // 10 // BATCH * BATCH
    state = {"epoch": 0, "consumed": consumed, "stream": True, "processes": 1}
    times: dict[str, list[float]] = {"fresh": [], "seek": [], "read": []}
    for _ in range(reps):
        for arm in times:
            loader = lite.setup_dataloaders(DataLoader(Counting(samples, arm == "seek"), batch_size=BATCH,
                                                       num_workers=2))
            start = time.perf_counter()
            if arm != "fresh":
                loader.load_state_dict(state)
            first = next(iter(loader))
            times[arm].append(time.perf_counter() - start)
            assert first[0] == (0 if arm == "fresh" else consumed)
    return {"samples": samples, "consumed": consumed, "first_batch_s": times}


def per_batch(reps: int, batches: int, stream: bool = False) -> dict[str, object]:
    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu")
    data = torch.randn(batches * BATCH, 8)
    if stream:
        arms = {"plain": DataLoader(Rows(data), batch_size=BATCH),
                "lite": lite.setup_dataloaders(DataLoader(Rows(data), batch_size=BATCH))}
    else:
        arms = {"plain": DataLoader(TensorDataset(data), batch_size=BATCH, shuffle=True),
                "lite": lite.setup_dataloaders(DataLoader(TensorDataset(data), batch_size=BATCH, shuffle=True))}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(reps):
        for name, loader in arms.items():
            start = time.perf_counter_ns()
            for _batch in loader:
                pass
            times[name].append((time.perf_counter_ns() - start) / batches)
    return {"ns_per_batch": times, "calls_per_batch": {name: calls(loader, batches) for name, loader in arms.items()}}


def calls(loader: DataLoader, batches: int) -> float:
    counted: Counter[str] = Counter()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event in ("call", "c_call"):
            counted[event] += 1

    sys.setprofile(profile)
    try:
        for _batch in loader:
            pass
    finally:
        sys.setprofile(None)
    return sum(counted.values()) / batches


def deep_resume(samples: int, reps: int) -> dict[str, object]:
    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu")
    consumed = samples * 9 // 10 // BATCH * BATCH
    state = {"epoch": 0, "consumed": consumed, "order": {"seed": 1234}}
    plain_s, lite_s = [], []
    for _ in range(reps):
        plain = DataLoader(Cheap(samples), batch_size=BATCH, shuffle=True, num_workers=2)
        start = time.perf_counter()
        next(iter(plain))
        plain_s.append(time.perf_counter() - start)
        loader = lite.setup_dataloaders(DataLoader(Cheap(samples), batch_size=BATCH, shuffle=True, num_workers=2))
        start = time.perf_counter()
        loader.load_state_dict(state)
        first = next(iter(loader))
        lite_s.append(time.perf_counter() - start)
    assert len(first) == BATCH
    # Plain PyTorch has no way to skip: it fetches the batches before the position. Timed on a
    # tenth of them and scaled (it is linear in the batches fetched).
    tenth = consumed // BATCH // 10
    plain = iter(DataLoader(Cheap(samples), batch_size=BATCH, shuffle=True, num_workers=2))
    start = time.perf_counter()
    for _ in range(tenth):
        next(plain)
    fetch_s = (time.perf_counter() - start) * 10
    return {"samples": samples, "consumed": consumed, "plain_first_batch_s": plain_s, "lite_load_and_first_batch_s": lite_s,
            "plain_fetch_to_position_s": fetch_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batches", type=int, default=256)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--resume-reps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"per_batch": per_batch(args.reps, args.batches),
              "deep_resume": deep_resume(args.samples, args.resume_reps),
              "stream_per_batch": per_batch(args.reps, args.batches, stream=True),
              "stream_resume": stream_resume(args.samples, args.resume_reps)}
    write_json(args.out, result)
    batch = result["per_batch"]["ns_per_batch"]
    print({name: statistics.median(v) for name, v in batch.items()}, result["per_batch"]["calls_per_batch"])
    print({k: v for k, v in result["deep_resume"].items()})
    stream = result["stream_per_batch"]
    print({name: statistics.median(v) for name, v in stream["ns_per_batch"].items()}, stream["calls_per_batch"])
    print({name: statistics.median(v) for name, v in result["stream_resume"]["first_batch_s"].items()})


if __name__ == "__main__":
    main()
