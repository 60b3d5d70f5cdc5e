"""Checkpoints at a URL (or a local folder) in a 2-process job: what `tests/integration/test_cloud_checkpoints.py` runs.

    python cloud_checkpoint.py STRATEGY MODE BASE [HANDSHAKE_DIR | LOCAL_DIR]

STRATEGY: ddp, fsdp (sharded, torch distributed checkpoint), fsdp_full (one file), model_parallel
(dp1 x tp2, sharded through the same torch distributed checkpoint code as fsdp) or pipeline
(model_parallel with 2 pipeline stages, 2 micro-batches: each stage saves its own layers).
BASE: where checkpoints go, a local folder or a URL (`s3://bucket/run`); the S3 client is set up
by the environment (AWS_ENDPOINT_URL, credentials), as a user's job would be.

MODE
- `train`: 2 steps, a blocking save to BASE/step-2, 1 step, a background save to BASE/step-3,
  1 more step; then a fresh model and optimizer load BASE/step-2 and train 2 steps. Rank 0 prints
  `digest NAME HEX` for the state it saved and the state after resuming, and `latest LATEST`;
  for sharded saves it then runs `lite consolidate` on BASE/step-2 (into BASE/step-2-whole.pt)
  and prints `digest consolidated HEX`. With LOCAL_DIR, the same training first runs in the same
  job with LOCAL_DIR for BASE (no consolidation), its lines prefixed `local `, so that one job
  compares a local folder with the URL.
- `fault-blocking` / `fault-background`: a save to BASE/step-1, then one to BASE/step-2 whose
  first write into the store waits for the test to stop the S3 server (HANDSHAKE_DIR/trigger ->
  HANDSHAKE_DIR/stopped). Every rank prints `rank R failed: MESSAGE`, then, once the test has
  started the server again (HANDSHAKE_DIR/failed-R -> HANDSHAKE_DIR/restarted), `rank R
  previous: STEP`, `rank R broken: MESSAGE` and `rank R latest: LATEST`.
- `errors`: a save and a load at BASE/ckpt for each of three faults, in this order; every rank
  prints `rank R FAULT save: MESSAGE` and `rank R FAULT load: MESSAGE`. `missing bucket`: a
  bucket that does not exist; `unreachable endpoint`: AWS_ENDPOINT_URL names a port where nothing
  listens; `wrong credentials`: rank 0 asks the test to make the server check every key
  (HANDSHAKE_DIR/credentials -> HANDSHAKE_DIR/checking).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lite_core import LightningLite
from lite_core.checkpoint import TorchCheckpointIO, latest
from lite_core.errors import CheckpointError

torch.set_num_threads(1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def digest(state: dict[str, torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for name in sorted(state):
        hasher.update(name.encode())
        hasher.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]


def wait_for(path: Path) -> None:
    """Wait for the test's signal; the test's own timeout is the hang guard."""
    while not path.exists():
        time.sleep(0.05)


class Job(LightningLite):
    def run(self, mode: str, base: str, handshake: str | None) -> None:
        if mode == "train":
            if handshake is not None:
                self.train(*self.build(), handshake, prefix="local ", consolidate=False)
            self.train(*self.build(), base)
            return
        model, optimizer = self.build()
        if mode.startswith("fault"):
            self.fault(model, optimizer, base, Path(handshake or "."), blocking=mode == "fault-blocking")
        else:
            self.errors(model, base, Path(handshake or "."))

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = make_model()
        return self.setup(model, torch.optim.Adam(model.parameters(), lr=0.05))

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed * 10 + self.global_rank)
        x = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        # Under a pipeline the schedule runs the loss: the set-up model takes the target (here unused).
        self.backward(model(x, target=x) if sys.argv[1] == "pipeline" else squared_mean(model(x)))
        optimizer.step()

    def train(self, model: nn.Module, optimizer: torch.optim.Optimizer, base: str, prefix: str = "",
              consolidate: bool = True) -> None:
        for seed in range(2):
            self.step(model, optimizer, seed)
        saved = digest(self.full_state_dict(model))  # now: its tensors may be the live parameters
        self.save({"model": model, "optimizer": optimizer, "step": 2}, join(base, "step-2"))
        self.step(model, optimizer, 2)
        self.save({"model": model, "optimizer": optimizer, "step": 3}, join(base, "step-3"), blocking=False)
        at_background_save = digest(self.full_state_dict(model))
        self.step(model, optimizer, 3)
        self.wait_for_checkpoint()

        fresh, fresh_optimizer = self.build()
        content = self.load(join(base, "step-2"), {"model": fresh, "optimizer": fresh_optimizer})
        loaded = digest(self.full_state_dict(fresh))
        for seed in (2, 3):
            self.step(fresh, fresh_optimizer, seed)
        resumed = digest(self.full_state_dict(fresh))
        background, background_optimizer = self.build()
        self.load(join(base, "step-3"), {"model": background, "optimizer": background_optimizer})
        loaded_background = digest(self.full_state_dict(background))
        if self.global_rank == 0:
            print(f"{prefix}digest saved {saved}", flush=True)
            print(f"{prefix}digest loaded {loaded} equal {loaded == saved}", flush=True)
            print(f"{prefix}digest resumed {resumed} step {content['step']}", flush=True)
            print(f"{prefix}digest background {loaded_background} equal {loaded_background == at_background_save}", flush=True)
            print(f"{prefix}latest {os.path.basename(latest(base) or 'none')}", flush=True)
            if consolidate and self.is_sharded_save():  # `lite consolidate` reads the shards from where they are
                whole = join(base, "step-2-whole.pt")
                subprocess.run([sys.executable, "-m", "lite_core.cli", "consolidate", join(base, "step-2"), whole],
                               check=True, stdout=subprocess.DEVNULL)
                print(f"digest consolidated {digest(TorchCheckpointIO().load(whole)['model'])}", flush=True)

    def is_sharded_save(self) -> bool:
        return getattr(self.strategy, "state_dict_type", None) == "sharded"

    def fault(self, model: nn.Module, optimizer: torch.optim.Optimizer, base: str, handshake: Path,
              blocking: bool) -> None:
        rank = self.global_rank
        self.save({"model": model, "optimizer": optimizer, "step": 1}, join(base, "step-1"))
        self.step(model, optimizer, 1)
        stop_the_store_during_the_first_write_of(join(base, "step-2"), handshake)
        try:
            self.save({"model": model, "optimizer": optimizer, "step": 2}, join(base, "step-2"), blocking=blocking)
            self.wait_for_checkpoint()
            print(f"rank {rank} failed: nothing", flush=True)
        except CheckpointError as err:
            print(f"rank {rank} failed: {err}", flush=True)
        (handshake / f"failed-{rank}").touch()
        wait_for(handshake / "restarted")
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # connections to the stopped server are gone
        content = self.load(join(base, "step-1"), {"model": model, "optimizer": optimizer})
        print(f"rank {rank} previous: {content['step']}", flush=True)
        try:
            self.load(join(base, "step-2"), {"model": model, "optimizer": optimizer})
            print(f"rank {rank} broken: loaded", flush=True)
        except CheckpointError as err:
            print(f"rank {rank} broken: {err}", flush=True)
        print(f"rank {rank} latest: {os.path.basename(latest(base) or 'none')}", flush=True)

    def errors(self, model: nn.Module, base: str, handshake: Path) -> None:
        import s3fs

        endpoint = os.environ["AWS_ENDPOINT_URL"]
        for fault in ("missing bucket", "unreachable endpoint", "wrong credentials"):
            path = join(base, "ckpt")
            if fault == "missing bucket":
                path = "s3://no-such-bucket/run/ckpt"
            os.environ["AWS_ENDPOINT_URL"] = endpoint_where_nothing_listens() if "endpoint" in fault else endpoint
            if fault == "wrong credentials":
                self.barrier()
                if self.global_rank == 0:
                    (handshake / "credentials").touch()
                wait_for(handshake / "checking")
            s3fs.S3FileSystem.clear_instance_cache()  # a client made now reads the environment again
            self.try_save_and_load(model, path, fault)

    def try_save_and_load(self, model: nn.Module, path: str, fault: str) -> None:
        rank = self.global_rank
        for what, call in (("save", lambda: self.save({"model": model}, path)),
                           ("load", lambda: self.load(path, {"model": model}))):
            try:
                call()
                print(f"rank {rank} {fault} {what}: worked", flush=True)
            except CheckpointError as err:
                print(f"rank {rank} {fault} {what}: {err}", flush=True)


def endpoint_where_nothing_listens() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def join(base: str, name: str) -> str:
    return f"{base}/{name}" if "://" in base else os.path.join(base, name)


def stop_the_store_during_the_first_write_of(prefix: str, handshake: Path) -> None:
    """The first write of any rank into a file under `prefix` (a shard, or the one file) tells the
    test to stop the S3 server and goes on once it has: the rest of that upload meets no server
    (under sharded fsdp in the background: torch distributed checkpoint's writer thread)."""
    from fsspec.spec import AbstractBufferedFile

    key = prefix.split("://", 1)[1]
    write = AbstractBufferedFile.write

    def write_after_the_stop(self: AbstractBufferedFile, data: bytes) -> int:
        # A shard (or the one file), not the small `lite_extra.pt` that rank 0 writes before the shards.
        planted = key.rpartition("/")[0] in self.path and "step-2" in self.path and "lite_extra" not in self.path
        if planted and not handshake.joinpath("stopped").exists():
            try:
                os.close(os.open(handshake / "trigger", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            wait_for(handshake / "stopped")
        return write(self, data)

    AbstractBufferedFile.write = write_after_the_stop  # type: ignore[method-assign]


def strategy(name: str) -> object:
    if name == "fsdp_full":
        from lite_core.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(state_dict_type="full")
    if name == "model_parallel":
        from lite_core.strategies import ModelParallelStrategy

        return ModelParallelStrategy(tensor_parallel, tensor_parallel_size=2)
    if name == "pipeline":
        from lite_core.strategies import ModelParallelStrategy

        return ModelParallelStrategy(None, pipeline_parallel_size=2, microbatches=2, split_points=["2"],
                                     loss_fn=lambda output, target: squared_mean(output))
    return name


def squared_mean(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def tensor_parallel(model: nn.Module, device_mesh: object) -> nn.Module:
    """dp1 x tp2: the first layer column-wise, the last row-wise over the tensor-parallel dimension."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


if __name__ == "__main__":
    Job(accelerator="cpu", strategy=strategy(sys.argv[1]), devices=2).run(
        sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
