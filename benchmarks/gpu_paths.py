"""The GPU check's paths that have not run on a GPU before, each against plain PyTorch:

- `background save`: `save(..., blocking=False)` of a model on the device, the loop going on at
  once: the file holds the weights of the moment of the call, bitwise (the copy to host memory
  must finish before the next step changes them);
- `fsdp compiled`: `strategy="fsdp"` on one device with a `torch.compile`d model: the set-up model
  is the user's (class, `state_dict()` keys) and trains as the same compiled model by hand;
- `pipeline`: `ModelParallelStrategy(pipeline_parallel_size=2)` on 2 ranks (NCCL on GPUs) against
  one plain process; below 2 GPUs the ranks share device 0 as two nodes (see `_two_ranks.py`);
- `ddp_ft`: two replica groups of one process each under `strategy="ddp_ft"` (a torchft
  lighthouse in this process), with `setup_dataloaders(..., split_batches=True)`, against one plain
  process on the whole batches. On a GPU both groups share device 0 and meet over torchft's NCCL
  process group, each with its own `NCCL_HOSTID` (`_two_ranks.py` says why). Skipped, with the
  reason, where torchft or lite-torchft is not importable (carry their wheels: install_wheels.sh).

    python benchmarks/gpu_paths.py --out RESULTS/gpu_paths.json            # on a GPU
    python benchmarks/gpu_paths.py --device cpu --out /tmp/gpu_paths.json  # the script itself, on a CPU

On a CPU the model is compiled with the `eager` backend (the compile wrapper without inductor's
minutes of C++ builds), and the pipeline and ddp_ft run over gloo. Exits 1 when a path differs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _two_ranks import node_variables, run_as_nodes, share_a_device, two_ranks  # noqa: E402

WIDTH, STEPS, LR = 64, 3, 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, WIDTH))


def batches(device: torch.device, count: int = STEPS, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, WIDTH, generator=generator).to(device),
             torch.randn(size, WIDTH, generator=generator).to(device)) for _ in range(count)]


def accelerator(device: torch.device) -> dict[str, object]:
    return {"accelerator": "cuda", "devices": [device.index or 0]} if device.type == "cuda" else {"accelerator": "cpu"}


def background_save(device: torch.device) -> dict[str, object]:
    from lite_core import LightningLite

    lite = LightningLite(**accelerator(device))
    model = make_model()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    data = batches(device, 2 * STEPS)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ckpt.pt"
        for step, (x, y) in enumerate(data):
            optimizer.zero_grad()
            lite.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            if step == STEPS - 1:
                at_save = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                lite.save({"model": model}, path, blocking=False)  # the next steps change the weights at once
        lite.wait_for_checkpoint()
        written = torch.load(path, weights_only=True)["model"]
    moved_on = any(not torch.equal(v.detach().cpu(), at_save[k]) for k, v in model.state_dict().items())
    worst = max((written[k] - at_save[k]).abs().max().item() for k in at_save)
    return {"ok": worst == 0.0 and moved_on, "max_difference": worst, "weights_moved_on": moved_on}


def fsdp_compiled(device: torch.device) -> dict[str, object]:
    from lite_core import LightningLite

    backend = "inductor" if device.type == "cuda" else "eager"
    plain = make_model().to(device)
    reference = torch.compile(copy.deepcopy(plain), backend=backend)
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    lite = LightningLite(strategy="fsdp", **accelerator(device))
    lite.launch()  # one process: its process group
    model, optimizer = lite.setup(torch.compile(plain, backend=backend), torch.optim.SGD(plain.parameters(), lr=LR))
    for x, y in batches(device):
        for net, opt, backward in ((model, optimizer, lite.backward), (reference, plain_optimizer, torch.Tensor.backward)):
            opt.zero_grad()
            backward(nn.functional.mse_loss(net(x), y))
            opt.step()
    expected = {k: v.detach().cpu() for k, v in reference._orig_mod.state_dict().items()}
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}
    same_class = isinstance(model, nn.Sequential)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected) if got.keys() == expected.keys() else None
    ok = same_class and worst is not None and worst < 1e-5
    return {"ok": ok, "max_difference": worst, "users_class": same_class, "keys_equal": got.keys() == expected.keys()}


def pipeline(device: torch.device) -> dict[str, object]:
    """In a job of its own (`--pipeline`: this script again, whose first process starts the second,
    or two nodes that share device 0)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "pipeline.json"
        argv = [__file__, "--device", device.type, "--out", str(out), "--pipeline"]
        if share_a_device(device.type):
            code, output = run_as_nodes(argv), "(the nodes' output is above)"
        else:
            proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)
            code, output = proc.returncode, (proc.stdout + proc.stderr)[-6000:]
        if code:
            return {"ok": False, "error": output}
        result = json.loads(out.read_text())
        return {**result, "ranks_share_device_0": share_a_device(device.type)}


def pipeline_job(device: torch.device) -> dict[str, object] | None:
    """The pipeline's 2 processes (`None` on the second)."""
    from lite_core import LightningLite
    from lite_core.strategies import ModelParallelStrategy

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    strategy = ModelParallelStrategy(None, pipeline_parallel_size=2, microbatches=2, pipeline_schedule="GPipe",
                                     split_points=["2"], loss_fn=loss_fn)
    lite = LightningLite(accelerator=device.type, strategy=strategy, **two_ranks())
    lite.launch()
    model = make_model()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    for x, y in batches(torch.device("cpu")):
        optimizer.zero_grad()
        lite.backward(model(x, target=y))
        optimizer.step()
    full = lite.strategy.full_module_state_dict(model)
    if not lite.is_global_zero:
        return None
    worst = max((full[k].cpu() - v).abs().max().item() for k, v in plain_weights().items())
    return {"ok": worst < 1e-5, "max_difference": worst}


def plain_weights() -> dict[str, torch.Tensor]:
    """The weights after the same steps in one plain PyTorch process on the CPU, on whole batches."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(torch.device("cpu")):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def ddp_ft(device: torch.device) -> dict[str, object]:
    """Two replica groups, each this script again (`--ddp-ft`), and one plain process here."""
    try:
        import lite_torchft  # noqa: F401
        from torchft._torchft import LighthouseServer
    except ImportError as err:
        return {"ok": True, "skipped": f"{err.name} is not importable (carry the torchft wheels, see install_wheels.sh)"}
    # both groups must be in every quorum: a group that asked first would otherwise step alone
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60000, heartbeat_timeout_ms=5000)
    try:
        with tempfile.TemporaryDirectory() as folder:
            procs = [_start_group(group, device, lighthouse.address().rsplit(":", 1)[1], Path(folder)) for group in (0, 1)]
            try:
                for proc in procs:
                    proc.wait(timeout=300)
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
            if any(proc.returncode for proc in procs):
                logs = (Path(folder) / f"group-{group}.log" for group in (0, 1))
                return {"ok": False, "error": "\n".join(log.read_text()[-3000:] for log in logs)}
            groups = [torch.load(Path(folder) / f"group-{group}.pt", weights_only=True) for group in (0, 1)]
    finally:
        lighthouse.shutdown()
    plain = plain_weights()
    worst = max((weights[k] - v).abs().max().item() for weights in groups for k, v in plain.items())
    agree = all(torch.equal(groups[0][k], groups[1][k]) for k in groups[0])
    return {"ok": worst < 1e-5 and agree, "max_difference": worst, "groups_bitwise_equal": agree}


def _start_group(group: int, device: torch.device, lighthouse_port: str, folder: Path) -> subprocess.Popen[bytes]:
    from lite_core.plugins import find_free_port

    port = find_free_port()  # the group's own store (one process)
    env = {**os.environ, "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": "2", **node_variables(f"lite-group-{group}"),
           "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with (folder / f"group-{group}.log").open("w") as log:  # a file, not a pipe nobody reads while waiting
        return subprocess.Popen([sys.executable, __file__, "--device", device.type, "--out",
                                 str(folder / f"group-{group}.pt"), "--ddp-ft"], env=env, stdout=log, stderr=subprocess.STDOUT)


def ddp_ft_job(device: torch.device, out: str) -> None:
    """One replica group: the user's loop, each global batch split between the groups."""
    from torch.utils.data import DataLoader, TensorDataset

    from lite_core import LightningLite
    from lite_torchft import DDPFTStrategy

    lite = LightningLite(strategy=DDPFTStrategy(ft_timeout=60), **accelerator(device))
    lite.launch()
    model = make_model()
    model, optimizer = lite.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    whole = batches(torch.device("cpu"))
    data = TensorDataset(torch.cat([x for x, _ in whole]), torch.cat([y for _, y in whole]))
    loader = lite.setup_dataloaders(DataLoader(data, batch_size=len(whole[0][0])), split_batches=True)
    for x, y in loader:
        optimizer.zero_grad()
        lite.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--pipeline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ddp-ft", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # both sides in true float32
        torch.backends.cudnn.allow_tf32 = False
    if args.pipeline:
        result = pipeline_job(device)
        if result is not None:
            Path(args.out).write_text(json.dumps(result))
        return 0
    if args.ddp_ft:
        ddp_ft_job(device, args.out)
        return 0
    results = {"background save": background_save(device), "fsdp compiled": fsdp_compiled(device)}
    results["ddp_ft"] = ddp_ft(device)  # these two start processes of their own
    results["pipeline"] = pipeline(device)
    Path(args.out).write_text(json.dumps(results, indent=2))
    for name, result in results.items():
        verdict = f"skipped, {result['skipped']}" if "skipped" in result else ("ok" if result["ok"] else "MISMATCH")
        print(f"gpu paths {name}: {verdict} {json.dumps({k: v for k, v in result.items() if k not in ('ok', 'skipped')})}")
    return 0 if all(result["ok"] for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
