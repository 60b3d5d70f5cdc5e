"""`fsdp` with one process: misuse errors, and bf16-mixed through fully_shard's policy.

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


if __name__ == "__main__":
    LightningLite(accelerator="cpu", strategy="fsdp", devices=1).launch(misuse)
    LightningLite(accelerator="cpu", strategy="fsdp", devices=1, precision="bf16-mixed").launch(bf16_mixed)
