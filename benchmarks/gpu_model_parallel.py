"""The GPU check's model-parallel cell: `ModelParallelStrategy` over NCCL on 2 or 4 GPUs (dp1 x tp2,
or dp2 x tp2 with 4), training a tensor-parallel MLP with clipping, compared with the same training
in one plain PyTorch process; then a sharded checkpoint saved and loaded back.

    python benchmarks/gpu_model_parallel.py --out RESULTS/gpu_model_parallel.json

Exits 0 with a line saying why when the machine has fewer than 2 GPUs; 1 when the numbers differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

SAMPLES, WIDTH, STEPS, LR, MAX_NORM, TOLERANCE = 64, 256, 4, 0.05, 0.5, 1e-4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, WIDTH, generator=generator), torch.randn(SAMPLES, WIDTH, generator=generator)


def parallelize(model: nn.Module, device_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def plain(device: torch.device) -> dict[str, torch.Tensor]:
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = (t.to(device) for t in make_data())
    batch = SAMPLES // STEPS
    for step in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step * batch:(step + 1) * batch]), y[step * batch:(step + 1) * batch]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def lite_run(devices: int, checkpoint: str) -> dict[str, object] | None:
    from torch.utils.data import DataLoader, TensorDataset

    from lite_core import LightningLite
    from lite_core.strategies import ModelParallelStrategy

    dp = 2 if devices >= 4 else 1
    lite = LightningLite(accelerator="cuda", devices=dp * 2,
                         strategy=ModelParallelStrategy(parallelize, data_parallel_size=dp, tensor_parallel_size=2))
    lite.launch()
    model = make_model()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = lite.setup_dataloaders(DataLoader(TensorDataset(*make_data()), batch_size=SAMPLES // STEPS // dp))
    norms = []
    for x, y in loader:
        optimizer.zero_grad()
        lite.backward(nn.functional.mse_loss(model(x), y))
        norms.append(lite.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    lite.save({"model": model, "optimizer": optimizer}, checkpoint)
    fresh = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    fresh, fresh_optimizer = lite.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=LR))
    lite.load(checkpoint, {"model": fresh, "optimizer": fresh_optimizer})
    reloaded = {k: v.full_tensor().cpu() for k, v in fresh.state_dict().items()}
    if not lite.is_global_zero:
        return None
    return {"layout": f"dp{dp} x tp2", "weights": full, "reloaded": reloaded, "norms": norms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "lite_gpu_model_parallel"))
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"model parallel: skipped, tensor parallelism needs 2 or more GPUs and this machine has {gpus}")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # both sides in true float32
    torch.backends.cudnn.allow_tf32 = False
    result = lite_run(gpus, args.checkpoint)
    if result is None:
        return 0
    expected = plain(torch.device("cuda", 0))
    worst = max((result["weights"][k] - expected[k]).abs().max().item() for k in expected)
    reload_worst = max((result["reloaded"][k] - result["weights"][k]).abs().max().item() for k in expected)
    ok = worst < TOLERANCE and reload_worst == 0.0
    summary = {"layout": result["layout"], "max_weight_difference_vs_plain": worst,
               "checkpoint_round_trip_difference": reload_worst, "norms": result["norms"], "ok": ok}
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"model parallel {result['layout']}: max |Lite - plain| {worst:.2e} (tolerance {TOLERANCE:g}),"
          f" checkpoint round trip {reload_worst:.1e}: {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
