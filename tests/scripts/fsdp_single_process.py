"""`fsdp` with one process: misuse errors, and bf16-mixed (autocast over float32 parameters).

    python fsdp_single_process.py

Prints one `OK <check>` line per check that passed; exits non-zero on the first failure.
"""

from __future__ import annotations

import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import MisuseError


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
    model = nn.Linear(3, 3)
    expect_misuse("optimizer before setup", lambda: lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                  "setup_module(model)", "setup_optimizers")
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
    model.module[1].register_forward_hook(lambda m, i, o: seen.append(i[0].dtype))  # the Linear's output
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


if __name__ == "__main__":
    import sys
    import tempfile

    from lite_core.strategies import FSDPStrategy

    LightningLite(accelerator="cpu", strategy="fsdp", devices=1).launch(misuse)
    LightningLite(accelerator="cpu", strategy="fsdp", devices=1, precision="bf16-mixed").launch(bf16_mixed)
    LightningLite(accelerator="cpu", strategy=FSDPStrategy(cpu_offload=True), devices=1).launch(cpu_offload)
    with tempfile.TemporaryDirectory() as folder:
        LightningLite(accelerator="cpu", strategy="fsdp", devices=1).launch(load_position_keyed, f"{folder}/plain.pt")
    sys.exit(0)
