"""Every DeepSpeed preset, bf16, checkpoints and misuse, in one pair of processes.

    python zero_train.py OUT_DIR

Starting DeepSpeed on 2 processes is slow, so one job runs one `LightningLite` after another in
the same 2 ranks (the first one launches them; the process group is reused). Rank 0 writes
`OUT_DIR/results.pt`: the data, and per run the globally averaged loss of every micro-batch, the
final full weights, the weights at the checkpoint, the losses after resuming, how the ZeRO-3
parameters were partitioned, and the messages of the misuse checks. The test replays the same
training with plain one-process PyTorch.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

import deepspeed.ops
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lite_core import LightningLite
from lite_core.errors import CheckpointError, MisuseError
from lite_core.plugins import forward_module

# Skip the 80-100 s JIT build of DeepSpeed's shared-memory allreduce (used for inference only).
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
torch.set_num_threads(1)

OUT = Path(sys.argv[1])
PRESETS = ["deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
           "deepspeed_stage_3", "deepspeed_stage_3_offload"]
SAMPLES, FEATURES, MICRO_BATCH, LR, MAX_NORM = 40, 4, 2, 0.05, 0.3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=generator),
                         torch.randn(SAMPLES, 1, generator=generator))


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, in fp32 (gathered from the shards under ZeRO-3)."""
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def partition_of(model: nn.Module) -> list[tuple[int, int, int]]:
    """Per parameter: elements held in `param.data`, in the whole parameter, in this rank's shard."""
    return [(p.numel(), getattr(p, "ds_numel", p.numel()), p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel())
            for p in model.parameters()]


class ZeroRun(LightningLite):
    """Steps 0-1: one micro-batch each; steps 2-3: two accumulated micro-batches and clipping.
    Then a checkpoint; steps 4-5 as 2-3; then a fresh model resumes from the checkpoint."""

    def run(self, tag: str) -> dict:
        model = make_model()  # outside init_module(): plain torch, partitioned by setup under ZeRO-3
        result = {"held_before_setup": [p.numel() for p in model.parameters()]}
        model, optimizer = self.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
        result["partition"] = partition_of(model)
        result["initial"] = full_weights(model)
        loader = self.setup_dataloaders(DataLoader(make_data(), batch_size=MICRO_BATCH))
        batches = iter(loader)
        result["losses"] = self.train(model, optimizer, batches, steps=4)
        engine = forward_module(model)
        result["batch_sizes"] = (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size())
        result["weights_at_save"] = full_weights(model)
        self.save({"model": model, "optimizer": optimizer, "step": 4, "note": tag}, OUT / f"ckpt_{tag}")
        remaining = list(batches)
        result["losses"] += self.train(model, optimizer, iter(remaining), steps=2)
        result["final"] = full_weights(model)
        try:
            result["resumed"] = self.resume(tag, remaining)
        except CheckpointError as err:
            result["resumed"] = str(err)
        return result

    def train(self, model, optimizer, batches, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            accumulate = self.step_count >= 2
            if accumulate:
                with self.no_backward_sync(model):
                    losses.append(self.micro_step(model, next(batches)))
            losses.append(self.micro_step(model, next(batches)))
            if accumulate:
                self.clip_gradients(model, optimizer, max_norm=MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            self.step_count += 1
        return losses

    def micro_step(self, model, batch) -> float:
        x, y = batch
        loss = nn.functional.mse_loss(model(x).float(), y)
        self.backward(loss, model=model)
        return self.all_reduce(loss.detach().float()).item()

    def resume(self, tag: str, remaining: list) -> dict:
        torch.manual_seed(99)  # other initial weights: the checkpoint must bring them back
        model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        model, optimizer = self.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
        state = {"model": model, "optimizer": optimizer, "step": 0, "note": ""}
        content = self.load(OUT / f"ckpt_{tag}", state)
        self.step_count = state["step"]
        losses = self.train(model, optimizer, iter(remaining), steps=2)
        return {"step": state["step"], "note": state["note"], "content_keys": sorted(content), "losses": losses}


class PlainTorchInRun(LightningLite):
    """ZeRO-3 bf16-mixed: the rest of run() is plain torch, an in-place edit of the model's output
    works, torch's foreach AdamW trains, and the config's activation_checkpointing is applied."""

    def run(self) -> dict:
        generator = torch.Generator().manual_seed(7)
        made = {"tensor": torch.tensor(0.0), "randn_cpu_generator": torch.randn(2, generator=generator),
                "zeros": torch.zeros(2)}
        result = {"made": {k: (t.dtype, t.device.type) for k, t in made.items()}}
        model = make_model()
        model, optimizer = self.setup(model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=True))
        losses = []
        for _ in range(3):
            out = model(torch.randn(4, FEATURES, generator=generator))
            out.mul_(2.0)  # in place on the output, as in plain PyTorch
            out += 1.0
            loss = out.float().pow(2).mean()
            self.backward(loss, model=model)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        result["losses"] = losses
        result["activation_checkpointing"] = _activation_checkpointing_state()
        return result


def _activation_checkpointing_state() -> dict:
    from deepspeed.runtime.activation_checkpointing import checkpointing

    return {"partition_activations": checkpointing.PARTITION_ACTIVATIONS,
            "cpu_checkpointing": checkpointing.CPU_CHECKPOINT, "number_checkpoints": checkpointing.num_layers,
            "synchronize": checkpointing.SYNCHRONIZE, "profile": checkpointing.PROFILE_TIME}


#: ZeRO-3 with DeepSpeed's activation checkpointing section (none of these are its defaults).
ACTIVATION_CHECKPOINTING = {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 3,
                            "synchronize_checkpoint_boundary": True, "profile": True}


class Misuse(LightningLite):
    def run(self) -> dict:
        messages = {}
        first, second = make_model(), make_model()
        first, opt1 = self.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
        second, opt2 = self.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
        x = torch.randn(2, FEATURES)
        loss = first(x).sum() + second(x).sum()
        messages["no_model"] = _message(lambda: self.backward(loss))
        self.backward(first(x).sum(), model=first)  # picks the engine: works
        messages["clip_val"] = _message(lambda: self.clip_gradients(first, opt1, clip_val=1.0))
        third = make_model()
        messages["two_optimizers"] = _message(lambda: self.setup(
            third, torch.optim.SGD(third[0].parameters(), lr=0.1), torch.optim.SGD(third[2].parameters(), lr=0.1)))
        scheduler = torch.optim.lr_scheduler.StepLR(opt1, step_size=1, gamma=0.5)
        self.backward(first(x).sum(), model=first)
        opt1.step()
        scheduler.step()
        messages["lr_after_schedule"] = opt1.optimizer.optimizer.param_groups[0]["lr"]
        messages["module_alone"] = _message(lambda: self.setup_module(make_model()))
        messages["optimizers_alone"] = _message(lambda: self.setup_optimizers(torch.optim.SGD(make_model().parameters())))
        messages["direct_backward"] = _message(lambda: first(x).sum().backward())
        messages["in_place_on_output"] = _message(lambda: self.in_place_backward(first, x))
        messages["reserved_key"] = _message(lambda: self.save(
            {"model": first, "optimizer": opt1, "global_steps": 3}, OUT / "ckpt_reserved"))
        messages["optimizer_alone"] = _message(lambda: self.save({"optimizer": opt1}, OUT / "ckpt_optimizer_alone"))
        messages["layout_switch"] = self.switch_layouts(first, opt1)
        return messages

    def switch_layouts(self, model, optimizer) -> list:
        """One path saved as one file (no DeepSpeed model in it, as under another strategy), then
        as DeepSpeed's folder, then as one file again: per rank, what each load reads back; and
        the entries left beside the path. Rank 1 reads the folder late, as on a slow file system."""
        path, seen = OUT / "switch", []
        for step, content in [(1, {}), (2, {"model": model, "optimizer": optimizer}), (3, {})]:
            self.save({**content, "step": step}, path)
            if self.global_rank == 1 and step == 2:
                time.sleep(2)  # the next save must wait for this reader (passing needs no delay)
            seen.append((path.is_dir(), self.load(path)["step"]))
        self.barrier()
        every_rank = [None] * self.world_size
        dist.all_gather_object(every_rank, seen)
        return [every_rank, sorted(entry.name for entry in OUT.iterdir() if entry.name.startswith(".switch"))]

    def in_place_backward(self, model, x) -> None:
        out = model(x)  # 32-true: the engine's own output, not a cast copy
        out.mul_(2.0)
        out[0] += 1.0
        self.backward(out.sum(), model=model)


class NestedInit(LightningLite):
    """ZeRO-3: a model built under init_module() inside run() is partitioned too."""

    def run(self) -> dict:
        with self.init_module():
            model = make_model()
        partition = partition_of(model)
        inference = self.setup_module(model)  # stage 3 without an optimizer: an engine for inference
        with torch.no_grad():
            shape = tuple(inference(torch.randn(2, FEATURES)).shape)
        return {"partition": partition, "inference_shape": shape}


def _message(action) -> str:
    try:
        action()
    except (MisuseError, RuntimeError) as err:
        return str(err)
    return "no error"


def _record_teardown() -> None:
    # Registered before Lite's teardown, so it runs after it (atexit is last-in, first-out).
    (OUT / f"teardown_rank{os.environ['LOCAL_RANK']}.txt").write_text(
        "destroyed" if not dist.is_initialized() else "still initialized")


atexit.register(_record_teardown)

if __name__ == "__main__":
    results: dict = {"data": make_data().tensors, "runs": {}}
    for preset in PRESETS:
        runner = ZeroRun(accelerator="cpu", strategy=preset, devices=2)
        runner.step_count = 0
        results["runs"][preset] = runner.run(preset)
    from deepspeed.accelerator import get_accelerator

    low = [("deepspeed_stage_2", "bf16-true"), ("deepspeed_stage_3", "bf16-mixed")]
    if get_accelerator().is_fp16_supported():  # a CPU without AVX512-FP16/AMX-FP16 has no fp16 here
        low.append(("deepspeed_stage_2", "16-mixed"))
    for preset, precision in low:
        runner = ZeroRun(accelerator="cpu", strategy=preset, devices=2, precision=precision)
        runner.step_count = 0
        results["runs"][f"{preset}-{precision}"] = runner.run(f"{preset}-{precision}")
    from lite_deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(config={"zero_optimization": {"stage": 3},
                                         "activation_checkpointing": ACTIVATION_CHECKPOINTING})
    results["plain_torch"] = PlainTorchInRun(accelerator="cpu", strategy=strategy, devices=2, precision="bf16-mixed").run()
    results["misuse"] = Misuse(accelerator="cpu", strategy="deepspeed_stage_2", devices=2).run()
    results["nested_init"] = NestedInit(accelerator="cpu", strategy="deepspeed_stage_3", devices=2).run()
    if dist.get_rank() == 0:
        torch.save(results, OUT / "results.pt")
