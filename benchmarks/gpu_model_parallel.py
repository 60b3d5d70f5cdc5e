"""The GPU check's model-parallel cell: `ModelParallelStrategy` over NCCL (dp1 x tp2, or dp2 x tp2 on
4 GPUs), training a tensor-parallel MLP with clipping, compared with the same training in one plain
PyTorch process; then a sharded checkpoint saved and loaded back.

    python benchmarks/gpu_model_parallel.py --out RESULTS/gpu_model_parallel.json
    python benchmarks/gpu_model_parallel.py --device cpu --out /tmp/mp.json   # the script itself, over gloo

With fewer than 2 GPUs the two ranks share GPU 0 as two one-process nodes (see `_two_ranks.py`).
Exits 1 when the numbers differ.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _two_ranks import is_node, run_as_nodes, share_a_device, two_ranks  # noqa: E402

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


def lite_run(device: torch.device, checkpoint: str) -> dict[str, object] | None:
    from torch.utils.data import DataLoader, TensorDataset

    from lite_core import LightningLite
    from lite_core.strategies import ModelParallelStrategy

    dp = 2 if device.type == "cuda" and torch.cuda.device_count() >= 4 else 1
    ranks = {"devices": 4} if dp == 2 else two_ranks()
    lite = LightningLite(accelerator=device.type, **ranks,
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
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", default=None, help="default: beside --out")
    args = parser.parse_args()
    args.checkpoint = args.checkpoint or str(Path(args.out).resolve().with_suffix(".checkpoint"))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    if share_a_device(device.type) and not is_node():
        return run_as_nodes([__file__, *sys.argv[1:]])
    torch.backends.cuda.matmul.allow_tf32 = False  # both sides in true float32
    torch.backends.cudnn.allow_tf32 = False
    result = lite_run(device, args.checkpoint)
    if result is None:
        return 0
    shutil.rmtree(args.checkpoint, ignore_errors=True)  # it was loaded back; it need not travel with the results
    expected = plain(device)
    worst = max((result["weights"][k] - expected[k]).abs().max().item() for k in expected)
    reload_worst = max((result["reloaded"][k] - result["weights"][k]).abs().max().item() for k in expected)
    ok = worst < TOLERANCE and reload_worst == 0.0
    summary = {"layout": result["layout"], "ranks_share_device_0": is_node(), "max_weight_difference_vs_plain": worst,
               "checkpoint_round_trip_difference": reload_worst, "norms": result["norms"], "ok": ok}
    Path(args.out).write_text(json.dumps(summary, indent=2))
    shared = " (two nodes sharing device 0)" if is_node() else ""
    print(f"model parallel {result['layout']}{shared}: max |Lite - plain| {worst:.2e} (tolerance {TOLERANCE:g}),"
          f" checkpoint round trip {reload_worst:.1e}: {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
