"""Checkpoints at an `s3://` URL against moto's S3 server on 127.0.0.1: Lite against the same
work written by hand with fsspec and torch, in one run, interleaved, medians.

    python benchmarks/cloud_checkpoint.py [--mib 64] [--repeats 7] [--sharded]

Needs `moto[server]` and `s3fs` (`hatch.toml`'s `test` environment has both). By default one
process, one file (`single_device`). With `--sharded`, 2 processes under `fsdp`
(`_cloud_sharded_worker.py`, started by `lite run`): Lite's sharded save and load against torch
distributed checkpoint's `FsspecWriter`/`FsspecReader` by hand (`dcp.save`/`dcp.load` of
`get_model_state_dict`), and the stall of a background sharded save.

- `save`: `LightningLite.save(state, url)` (pending marker, upload to a temporary key, copy into
  place, marker removed) vs `torch.save` into `fsspec.open(url, "wb")` by hand (no commit rule).
- `load`: `LightningLite.load(url, state)` vs `torch.load` of the bytes read by hand +
  `load_state_dict`.
- the training stall of `save(..., blocking=False)` vs a blocking `save` (the time the loop waits).

The loopback store is fast and has no network latency: the ratios show Lite's own cost (the
copy into place is a memory copy here, a server-side copy on S3).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

from lite_core.plugins import find_free_port


def _model(mib: int) -> nn.Module:
    width = 1024
    layers = max(1, (mib << 20) // (4 * width * width))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _time(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="model size in MiB (float32 weights)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sharded", action="store_true", help="fsdp on 2 processes against DCP by hand")
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    port = find_free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.mkdir("bench")
    torch.set_num_threads(1)
    if args.sharded:
        median = _sharded(args.mib, args.repeats)
        server.stop()
        _report(f"{args.mib} MiB model under fsdp on 2 processes, {args.repeats} rounds, medians"
                f" (torch {torch.__version__}); by hand: torch distributed checkpoint's FsspecWriter/FsspecReader",
                median)
        return

    from lite_core import LightningLite

    lite = LightningLite(accelerator="cpu")
    model = _model(args.mib)
    model = lite.setup(model)
    plain_model = _model(args.mib)

    def plain_save() -> None:
        with fs.open("bench/plain.pt", "wb") as handle:
            torch.save({"model": plain_model.state_dict()}, handle)

    def plain_load() -> None:
        plain_model.load_state_dict(torch.load(io.BytesIO(fs.cat_file("bench/plain.pt")), weights_only=True)["model"])

    def lite_save() -> None:
        lite.save({"model": model}, "s3://bench/lite.pt")

    def lite_load() -> None:
        lite.load("s3://bench/lite.pt", {"model": model})

    def background_stall() -> None:
        lite.save({"model": model}, "s3://bench/background.pt", blocking=False)

    times: dict[str, list[float]] = {name: [] for name in
                                     ("plain save", "lite save", "plain load", "lite load", "stall")}
    for repeat in range(args.repeats + 1):  # the first round warms up
        round_times = {"plain save": _time(plain_save), "lite save": _time(lite_save),
                       "plain load": _time(plain_load), "lite load": _time(lite_load),
                       "stall": _time(background_stall)}
        lite.wait_for_checkpoint()
        if repeat:
            for name, seconds in round_times.items():
                times[name].append(seconds)
    server.stop()

    median = {name: statistics.median(values) for name, values in times.items()}
    _report(f"{args.mib} MiB model, {args.repeats} rounds, medians (torch {torch.__version__});"
            " by hand: torch.save into fsspec.open, torch.load of fs.cat_file", median)


def _sharded(mib: int, repeats: int) -> dict[str, float]:
    """Run `_cloud_sharded_worker.py` on 2 processes (`lite run`); its medians by name."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cloud_sharded_worker.py")
    done = subprocess.run([sys.executable, "-m", "lite_core.cli", "run", "--accelerator", "cpu", "--devices", "2",
                           worker, "s3://bench/sharded", str(mib), str(repeats)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("plain_save=")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the sharded worker failed:\n{done.stdout}\n{done.stderr}")
    return {name.replace("_", " "): float(value) for name, value in (pair.split("=") for pair in lines[-1].split())}


def _report(title: str, median: dict[str, float]) -> None:
    print(f"{title}:")
    print(f"save to s3://: by hand {median['plain save']:.3f} s, Lite {median['lite save']:.3f} s,"
          f" ratio {median['lite save'] / median['plain save']:.3f}")
    print(f"load from s3://: by hand {median['plain load']:.3f} s, Lite {median['lite load']:.3f} s,"
          f" ratio {median['lite load'] / median['plain load']:.3f}")
    print(f"training stall: save(blocking=False) {median['stall']:.3f} s vs blocking save {median['lite save']:.3f} s,"
          f" ratio {median['stall'] / median['lite save']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
