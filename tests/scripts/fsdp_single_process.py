"""`fsdp` with one process: misuse errors, bf16-mixed (autocast over float32 parameters), and
`setup(model, optimizer)` with an optimizer (and scheduler) built before setup.

    python fsdp_single_process.py

Prints one `OK <check>` line per check that passed; exits non-zero on the first failure.
"""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path

import torch
from torch import nn

import _snapshot
from lite_core import LightningLite
from lite_core.errors import CheckpointError, MisuseError


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def expect_misuse(check: str, fn, *words: str) -> None:
    try:
        fn()
    except MisuseError as err:
        message = str(err)
        assert all(w in message for w in words), message
        assert message.count(". ") == 0 and message.endswith("."), f"not one sentence: {message}"
        print(f"OK {check}: {message}")
        return
    raise AssertionError(f"{check}: no MisuseError")


def misuse(lite: LightningLite) -> None:
    other = nn.Linear(3, 3)
    wrapped = lite.setup_module(nn.Linear(3, 3))
    expect_misuse("optimizer of unsharded parameters",
                  lambda: lite.setup_optimizers(torch.optim.SGD(other.parameters(), lr=0.1)), "setup_module()")
    with lite.init_module(empty_init=True):
        no_reset = nn.Sequential(nn.Linear(3, 3), NoReset())
    expect_misuse("empty_init without reset_parameters", lambda: lite.setup_module(no_reset),
                  "reset_parameters()", "empty_init=False")
    assert wrapped is not None


def bf16_mixed(lite: LightningLite) -> None:
    model = lite.setup_module(nn.Sequential(nn.Linear(4, 2), nn.Identity()))
    optimizer = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(i[0].dtype))  # the Linear's output
    out = model(torch.randn(8, 4))
    lite.backward(out.pow(2).mean())
    optimizer.step()
    assert seen == [torch.bfloat16], seen
    assert out.dtype == torch.float32, out.dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    print("OK bf16-mixed: computes in bfloat16, keeps float32 weights, gradients and outputs")


def cpu_offload(lite: LightningLite) -> None:
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model = lite.setup_module(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    assert all(p.device.type == "cpu" for p in model.parameters())
    model.load_state_dict(reference.state_dict())  # full weights into the sharded model
    optimizer = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    plain_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(3):
        optimizer.zero_grad()
        lite.backward(model(x).pow(2).mean())
        optimizer.step()
        plain_optimizer.zero_grad()
        reference(x).pow(2).mean().backward()
        plain_optimizer.step()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name].full_tensor(), tensor, atol=1e-6, rtol=0)
    print("OK cpu_offload: trains like plain PyTorch")


def load_position_keyed(lite: LightningLite, path: str) -> None:
    """A checkpoint saved by another strategy (`Optimizer.state_dict()`, keyed by position)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    plain_optimizer = torch.optim.Adam(plain.parameters())
    plain(torch.ones(2, 4)).sum().backward()
    plain_optimizer.step()
    torch.save({"model": plain.state_dict(), "optimizer": plain_optimizer.state_dict(), "step": 1}, path)
    model = lite.setup_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    optimizer = lite.setup_optimizers(torch.optim.Adam(model.parameters()))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    lite.load(path, state)
    assert state["step"] == 1
    for name, tensor in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name].full_tensor(), tensor), name
    for param, expected in zip(optimizer.param_groups[0]["params"], plain_optimizer.param_groups[0]["params"]):
        got = optimizer.state[param]["exp_avg"]
        assert torch.equal(got.full_tensor(), plain_optimizer.state[expected]["exp_avg"])
    print("OK position-keyed checkpoint: restored under fsdp")


def param_groups(model: nn.Module) -> list[dict]:
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01, "betas": (0.5, 0.9)}]


def setup_with_optimizer(lite: LightningLite, folder: str) -> None:
    """The loop a user writes for ddp: optimizer and scheduler built before setup(model, optimizer)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model = copy.deepcopy(reference)
    plain_optimizer = torch.optim.Adam(param_groups(reference), lr=0.05)
    optimizer = torch.optim.Adam(param_groups(model), lr=0.05)
    x = torch.randn(8, 4)
    for module, opt in ((reference, plain_optimizer), (model, optimizer)):  # state made before setup
        module(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain_optimizer, step_size=1, gamma=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, set_up = lite.setup(model, optimizer)
    assert set_up.optimizer is optimizer and isinstance(set_up, torch.optim.Adam)
    assert [g["betas"] for g in optimizer.param_groups] == [(0.9, 0.999), (0.5, 0.9)], optimizer
    for _ in range(3):
        set_up.zero_grad()
        lite.backward(model(x).pow(2).mean())
        set_up.step()
        scheduler.step()
        plain_optimizer.zero_grad()
        reference(x).pow(2).mean().backward()
        plain_optimizer.step()
        plain_scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in plain_optimizer.param_groups] == [
        0.05 / 8, 0.01 / 8]
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name].full_tensor(), tensor, atol=1e-6, rtol=0)
    print("OK setup(model, optimizer): groups, state and a scheduler built before setup carry over")

    # A checkpoint written with setup_module + setup_optimizers loads into setup(model, optimizer).
    lite.save({"model": model, "optimizer": set_up, "scheduler": scheduler}, f"{folder}/by_setup")
    torch.manual_seed(1)
    other = lite.setup_module(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    other_optimizer = lite.setup_optimizers(torch.optim.Adam(param_groups(other), lr=0.05))
    state = {"model": other, "optimizer": other_optimizer,
             "scheduler": torch.optim.lr_scheduler.StepLR(other_optimizer, step_size=1, gamma=0.5)}
    lite.load(f"{folder}/by_setup", state)
    lite.save(state, f"{folder}/by_setup_module")
    torch.manual_seed(2)
    again = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    again_optimizer = torch.optim.Adam(param_groups(again), lr=0.05)
    again_scheduler = torch.optim.lr_scheduler.StepLR(again_optimizer, step_size=1, gamma=0.5)
    again, again_optimizer = lite.setup(again, again_optimizer)
    lite.load(f"{folder}/by_setup_module", {"model": again, "optimizer": again_optimizer, "scheduler": again_scheduler})
    assert again_scheduler.state_dict() == scheduler.state_dict()
    assert [g["lr"] for g in again_optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
    for name, tensor in reference.state_dict().items():
        assert torch.equal(again.state_dict()[name].full_tensor(), model.state_dict()[name].full_tensor()), name
    for mine, theirs in zip(again_optimizer.param_groups[1]["params"], optimizer.param_groups[1]["params"]):
        assert torch.equal(again_optimizer.state[mine]["exp_avg"].full_tensor(),
                           optimizer.state[theirs]["exp_avg"].full_tensor())
    print("OK checkpoints across setup styles: written either way, loaded either way")


class RunsACommand:
    """A `.metadata` a stranger put in a shared bucket: unpickling it calls `os.system`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch '{self.marker}'",)


def hostile_metadata(lite: LightningLite, folder: str) -> None:
    """fsdp's own loading route (`load(path, state)` into sharded modules) reads `.metadata` safely."""
    model = lite.setup_module(nn.Linear(3, 3))
    lite.save({"model": model}, f"{folder}/shared")
    marker = Path(folder) / "ran"
    Path(f"{folder}/shared/.metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    try:
        lite.load(f"{folder}/shared", {"model": model})
    except CheckpointError as err:
        assert "call load(..., weights_only=False)" in str(err), err
    else:
        raise AssertionError("a .metadata that runs a command was loaded")
    assert not marker.exists(), "the checkpoint's command ran"
    print("OK hostile metadata: refused under fsdp, and nothing ran")


def snapshot(lite: LightningLite) -> None:
    lost, unchanged = _snapshot.taken_before_a_step(lite)
    assert not lost, f"full_state_dict handed out the model's own tensors: {lost} changed with the next step"
    assert not unchanged, f"the step left {unchanged} as they were: the check would prove nothing"
    print("OK full_state_dict is a copy: a snapshot keeps the weights and statistics of when it was taken")


if __name__ == "__main__":
    import sys
    import tempfile

    from lite_core.strategies import FSDPStrategy

    LightningLite(accelerator="cpu", strategy="fsdp", devices=1).launch(misuse)
    LightningLite(accelerator="cpu", strategy="fsdp", devices=1).launch(snapshot)
    LightningLite(accelerator="cpu", strategy="fsdp", devices=1, precision="bf16-mixed").launch(bf16_mixed)
    LightningLite(accelerator="cpu", strategy=FSDPStrategy(cpu_offload=True), devices=1).launch(cpu_offload)
    with tempfile.TemporaryDirectory() as folder:
        LightningLite(accelerator="cpu", strategy="fsdp", devices=1).launch(load_position_keyed, f"{folder}/plain.pt")
        LightningLite(accelerator="cpu", strategy="fsdp", devices=1).launch(setup_with_optimizer, folder)
        LightningLite(accelerator="cpu", strategy="fsdp", devices=1).launch(hostile_metadata, folder)
    sys.exit(0)
