"""The matrix's one user-level training scenario: the same loop, seed and data under every cell.

    python scenario.py OUT_DIR                 train STEPS steps from the seeded initial weights
    python scenario.py OUT_DIR --resume CKPT   load CKPT (saved after SAVE_AT steps), train the rest

The constructor arguments come from the environment, as `lite run` passes them:
`LITE_ACCELERATOR`, `LITE_STRATEGY`, `LITE_DEVICES`, `LITE_PRECISION`; the script passes none.
Every step consumes the same GLOBAL_BATCH samples whatever the number of processes, so the losses
and weights equal one plain PyTorch process that trains on the whole global batch (`reference.py`).

Rank 0 writes `OUT_DIR/result.json`: the per-step losses (averaged over the ranks), the loaded
step when resuming, the strategy, world size and precision, and the final weights as full
tensors read back from the final checkpoint. A training run also leaves `OUT_DIR/checkpoint`,
saved after SAVE_AT steps with the model, the optimizer and the step, for the checkpoint matrix.
On a `load` that Lite refuses, the script writes the error's text instead (`"error"`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("LITE_XLA_CPU_HARNESS") == "1":  # XLA replicas as threads on a CPU host (test-only)
    sys.path.insert(0, str(_ROOT / "packages" / "lite-xla" / "tests" / "scripts"))
    import _cpu_harness

    _cpu_harness.install()

if os.environ.get("LITE_STRATEGY", "").startswith("deepspeed"):
    # Test-only, to save CI time: skip the JIT build (80-100 s) of DeepSpeed's shared-memory
    # all-reduce, which only inference uses.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.errors import CheckpointError
from lite_core.strategies import FSDPStrategy

torch.set_num_threads(1)

SAMPLES, FEATURES, GLOBAL_BATCH, LR = 48, 4, 8, 0.05
STEPS = SAMPLES // GLOBAL_BATCH
SAVE_AT = 3
SEED = 0
#: After training, the accumulation loop of docs/convert.md goes on from the trained weights:
#: ACCUMULATED_STEPS optimizer steps of ACCUMULATE micro-batches (each a global batch) each.
ACCUMULATE, ACCUMULATED_STEPS = 2, 2


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LR, eps=1e-4)  # eps=1e-8 is 0 in float16 (16-true)


def mse_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss in float32, or in float64 when the model computes in float64 (never in 16 bits)."""
    dtype = torch.promote_types(out.dtype, y.dtype)
    return nn.functional.mse_loss(out.to(dtype), y.to(dtype))


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=generator))


class Scenario(LightningLite):
    def run(self, out_dir: str, resume: str | None) -> dict[str, Any]:
        torch.manual_seed(SEED if resume is None else SEED + 99)  # resuming must bring the weights back
        model = make_model()
        self.computed_in: list[str] = []  # the dtype the first layer computed in, per forward pass
        model[0].register_forward_hook(lambda module, args, out: self.computed_in.append(str(out.dtype)))
        model, optimizer = self.setup_training(model)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
        if resume is not None:
            try:
                self.load(resume, state)
            except CheckpointError as err:
                return {"error": str(err)}
        replicas = (self.strategy.distributed_sampler_kwargs() or {"num_replicas": 1})["num_replicas"]
        loader = self.setup_dataloaders(DataLoader(make_data(), batch_size=GLOBAL_BATCH // replicas))
        losses = []
        for step, (x, y) in enumerate(loader):
            if step < state["step"]:
                continue
            if resume is None and step == SAVE_AT:
                self.save(state, Path(out_dir, "checkpoint"))
            optimizer.zero_grad()
            loss = mse_loss(model(x), y)
            self.backward(loss)
            optimizer.step()
            state["step"] = step + 1
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        self.save({"model": model}, Path(out_dir, "final"))
        result = {"losses": losses, "resumed_at": None if resume is None else STEPS - len(losses)}
        if resume is None:  # in the same process: no start of its own
            result["accumulated_losses"] = self.accumulate(model, optimizer, loader, out_dir)
        result.update(failed_save=self.failed_save(model, out_dir), **self.what_ran())
        from evaluation import NOT_EVALUATED, evaluate_all  # its loops; test_evaluation.py checks them

        if resume is None and self._plan.precision.name == "32-true" and self.strategy.name not in NOT_EVALUATED:
            result["evaluation"] = evaluate_all(self, model)  # of the accumulated weights
        return result

    def accumulate(self, model: nn.Module, optimizer: Any, loader: Any, out_dir: str) -> list[float]:
        """The gradient-accumulation loop a user copies from docs/convert.md, going on from the
        trained model: one optimizer step per ACCUMULATE micro-batches, the gradients all-reduced
        on the step's last micro-batch only. Saves the weights to `accumulated`; returns the
        per-micro-batch losses (averaged over the ranks).

        It runs before the evaluation passes: under DDP a forward pass with gradients enabled
        that no backward follows (an evaluation in eval mode alone) leaves DDP expecting a
        synchronising backward, and the next one inside `no_sync()` all-reduces all the same."""
        optimizer.zero_grad()
        losses = []
        for i, (x, y) in enumerate(loader):
            if i == ACCUMULATE * ACCUMULATED_STEPS:
                break
            last = (i + 1) % ACCUMULATE == 0
            with self.no_backward_sync(model, enabled=not last):
                loss = mse_loss(model(x), y)
                self.backward(loss / ACCUMULATE)
            if last:
                optimizer.step()
                optimizer.zero_grad()
            losses.append(self.all_reduce(loss.detach(), reduce_op="mean").item())
        self.save({"model": model}, Path(out_dir, "accumulated"))
        return losses

    def failed_save(self, model: nn.Module, out_dir: str) -> dict[str, Any]:
        """What each rank raised from a save that cannot succeed (a function in the content), and
        rank 0's message: every rank must raise, none go on or wait for the others."""
        try:
            self.save({"model": model, "callback": lambda: None}, Path(out_dir, "unsaveable"))
            raised, message = "nothing", ""
        except Exception as err:  # recorded, compared by the test
            raised, message = type(err).__name__, str(err)
        kinds = self.all_gather(torch.tensor(RAISED.index(raised) if raised in RAISED else len(RAISED)))
        return {"raised": [RAISED[k] if k < len(RAISED) else "other" for k in kinds.flatten().tolist()],
                "message": message}

    def what_ran(self) -> dict[str, Any]:
        """What actually ran, seen from inside the run: a planted fault that swaps the strategy,
        the launcher or the precision cannot hide behind equal numbers."""
        strategy = self.strategy
        kinds = self.all_gather(torch.tensor(PROCESS_KINDS.index(_process_kind())))
        return {"strategy": strategy.name, "strategy_class": f"{type(strategy).__module__}:{type(strategy).__name__}",
                "accelerator": strategy.accelerator.name, "world_size": self.world_size,
                "precision": self._plan.precision.name, "processes": [PROCESS_KINDS[k] for k in kinds.flatten().tolist()],
                "computed_in": sorted(set(self.computed_in))}

    def setup_training(self, model: nn.Module) -> tuple[Any, Any]:
        if isinstance(self.strategy, FSDPStrategy):  # it replaces the parameters: optimizer after
            model = self.setup_module(model)
            return model, self.setup_optimizers(make_optimizer(model))
        return self.setup(model, make_optimizer(model))


#: What a rank raised from `failed_save`.
RAISED = ("CheckpointError", "nothing")

#: How a rank's process was started: the launching process itself (or a re-run of the script),
#: a `spawn` child, a `fork` child.
PROCESS_KINDS = ("MainProcess", "SpawnProcess", "ForkProcess", "other")


def _process_kind() -> str:
    import multiprocessing

    kind = multiprocessing.current_process().name.split("-")[0]
    return kind if kind in PROCESS_KINDS else "other"


def final_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's full weights from the checkpoint the strategy wrote at `path`."""
    from lite_core.checkpoint import consolidate, is_sharded

    if is_sharded(path):  # fsdp: a directory of shards
        consolidate(path, path.with_suffix(".pt"))
        return torch.load(path.with_suffix(".pt"), weights_only=True)["model"]
    if (path / "latest").is_file():  # DeepSpeed: ZeRO shards
        from lite_deepspeed import convert_to_fp32_state_dict

        return convert_to_fp32_state_dict(path, path.with_suffix(".pt"))
    if path.is_dir():  # xla_fsdp: one shard file per replica
        from lite_xla import consolidate_checkpoint

        return consolidate_checkpoint(path)["model"]
    return torch.load(path, weights_only=True)["model"]


def xla_harness_strategy() -> Any:
    """On a CPU host the XLA strategies need `pin_layout=False` (see `_cpu_harness.py`)."""
    name = os.environ.pop("LITE_STRATEGY", "xla")
    from lite_xla.strategies.fsdp import XLAFSDPStrategy
    from lite_xla.strategies.xla import XLAStrategy

    return (XLAFSDPStrategy if name == "xla_fsdp" else XLAStrategy)(pin_layout=False)


def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    """The scenario's MLP split by `model_parallel`: the first layer column-wise, the last row-wise,
    then FSDP2 over the data-parallel dimension."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, device_mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def model_parallel_scenario() -> Scenario:
    """`model_parallel` needs the user's function: the name in LITE_STRATEGY becomes an instance.
    The variable is set again afterwards, for the ranks that run this script again."""
    from lite_core.strategies import ModelParallelStrategy

    name = os.environ.pop("LITE_STRATEGY")
    try:
        return Scenario(strategy=ModelParallelStrategy(parallelize))
    finally:
        os.environ["LITE_STRATEGY"] = name


def main() -> None:
    out_dir = Path(sys.argv[1])
    resume = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--resume" else None
    harness = os.environ.get("LITE_XLA_CPU_HARNESS") == "1" and os.environ.get("LITE_DEVICES", "1") != "1"
    if harness:
        lite = Scenario(strategy=xla_harness_strategy())
    elif os.environ.get("LITE_STRATEGY") == "model_parallel":
        lite = model_parallel_scenario()
    else:
        lite = Scenario()
    result = lite.run(str(out_dir), resume)
    if lite.global_rank != 0:
        return
    if "error" not in result:
        result["weights"] = _flat_weights(out_dir / "final")
    if "accumulated_losses" in result:
        result["accumulated_weights"] = _flat_weights(out_dir / "accumulated")
    (out_dir / "result.json").write_text(json.dumps(result))


def _flat_weights(path: Path) -> dict[str, list[float]]:
    return {name: tensor.float().flatten().tolist() for name, tensor in final_weights(path).items()}


if __name__ == "__main__":
    main()
