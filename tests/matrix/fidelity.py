"""The set-up model is the user's model: what a plain-PyTorch user does with a model, observed.

    python fidelity.py OUT_DIR

The constructor arguments come from the environment (`LITE_STRATEGY`, `LITE_DEVICES`, ...), as in
`scenario.py`. One run per strategy observes every behaviour, in this order (later ones change
the model): names and structure, every kind of hook, two training steps and the whole state dict
on rank 0 (`lite.full_state_dict(model)`; plain: `model.state_dict()`), attribute, buffer and
submodule assignment, a parameter added after setup, `copy.deepcopy`, `model.double()`; then a
second model through `setup_module` and an optimizer built before it through `setup_optimizers`.
`observe()` is the user's code, the same for the plain model in the test process and for the
set-up model here; rank 0 writes `OUT_DIR/result.json` (`{"observed": {...}}`).

Every rank trains on its share of each global batch (rows `rank::world_size`), in eval mode (the
BatchNorm uses its running statistics, so the shares compute what the whole batch does): the
losses equal one plain process only if the gradients were averaged.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

if os.environ.get("LITE_STRATEGY", "").startswith("deepspeed"):
    import deepspeed.ops  # as in scenario.py: skip the JIT build of an op only inference uses

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

import torch
from torch import nn

from lite_core import LightningLite

torch.set_num_threads(1)

SEED, FEATURES, GLOBAL_BATCH, LR = 3, 4, 8, 0.1


class Net(nn.Module):
    """Linear, BatchNorm, activation and a submodule named `module`; a top-level parameter, a
    buffer and a plain attribute, each used by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES, 8)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU()
        self.module = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.full((2,), 1.5))
        self.register_buffer("mask", torch.ones(2))
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(self.act(self.bn(self.a(x)))) * self.scale * self.mask / self.temperature


def make_model() -> Net:
    torch.manual_seed(SEED)
    model = Net()
    model.bn.running_mean.uniform_(-0.5, 0.5)  # running statistics that are not the identity
    model.bn.running_var.uniform_(0.5, 1.5)
    return model


def batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randn(GLOBAL_BATCH, FEATURES, generator=generator), torch.randn(GLOBAL_BATCH, 2, generator=generator))
            for _ in range(steps)]


def probe() -> torch.Tensor:
    return torch.linspace(-1, 1, 3 * FEATURES).reshape(3, FEATURES)


class User:
    """How the user's code reaches its process: `backward(loss, model)`, the mean over ranks, its
    data share, and `setup_module`/`setup_optimizers` (nothing to do in plain PyTorch)."""

    def __init__(self, backward: Callable[..., None], mean: Callable[[torch.Tensor], float], rank: int = 0,
                 world_size: int = 1, setup_module: Callable[[Any], Any] = lambda m: m,
                 setup_optimizers: Callable[[Any], Any] = lambda o: o,
                 full_state_dict: Callable[[Any], dict[str, Any]] = lambda m: m.state_dict()) -> None:
        self.backward, self.mean, self.rank, self.world_size = backward, mean, rank, world_size
        self.setup_module, self.setup_optimizers, self.full_state_dict = setup_module, setup_optimizers, full_state_dict

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[self.rank::self.world_size]


def _output(model: nn.Module) -> list[float]:
    with torch.no_grad():
        return model(probe()).flatten().tolist()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, user: User, dtype: torch.dtype) -> list[float]:
    losses = []
    for x, y in batches():
        loss = nn.functional.mse_loss(model(user.share(x).to(dtype)), user.share(y).to(dtype))
        user.backward(loss, model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(user.mean(loss.detach()))
    return losses


def structure(model: nn.Module) -> dict[str, Any]:
    visited: list[str] = []
    model.apply(lambda module: visited.append("the model" if module is model else type(module).__name__))
    return {
        "named_parameters": [name for name, _ in model.named_parameters()],
        "named_buffers": [name for name, _ in model.named_buffers()],
        "named_modules": [name for name, _ in model.named_modules()],
        "named_children": [name for name, _ in model.named_children()],
        "modules": len(list(model.modules())),
        "children": len(list(model.children())),
        "apply": visited,
        "get_parameter": list(model.get_parameter("scale").shape),
        "get_submodule": type(model.get_submodule("module")).__name__,
        "get_buffer": model.get_buffer("mask").tolist(),
        "submodule_named_module": type(model.module).__name__,
        "isinstance": isinstance(model, Net),
        "state_dict_keys": list(model.state_dict()),
    }


def hooks(model: nn.Module, optimizer: torch.optim.Optimizer, user: User) -> list[str]:
    """Every kind of hook on the model: which fired, each with the model as its `module`."""
    fired: list[str] = []

    def note(kind: str) -> Callable[..., None]:
        def hook(module: nn.Module, *_: Any) -> None:
            fired.append(kind if module is model else f"{kind} on {type(module).__name__}")

        return hook

    handles = [
        model.register_forward_pre_hook(note("forward_pre")),
        model.register_forward_hook(note("forward")),
        model.register_full_backward_pre_hook(note("full_backward_pre")),
        model.register_full_backward_hook(note("full_backward")),
        model.register_state_dict_post_hook(note("state_dict_post")),
        model.register_load_state_dict_post_hook(note("load_state_dict_post")),
    ]
    x = user.share(batches()[0][0]).requires_grad_()
    user.backward(model(x).pow(2).mean(), model)
    optimizer.zero_grad()
    model.load_state_dict(model.state_dict())
    for handle in handles:
        handle.remove()
    return fired


def assignments(model: Any) -> dict[str, Any]:
    """Attribute, buffer and submodule assignment after setup, seen by forward and the state dict."""
    model.temperature = 2.0
    temperature = _output(model)
    model.mask = torch.tensor([1.0, 0.0])
    mask = _output(model)
    model.act = nn.Tanh()
    return {"attribute": temperature, "buffer": mask, "buffer_in_state_dict": model.state_dict()["mask"].tolist(),
            "submodule": _output(model)}


def _outcome(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except Exception as err:  # what the matrix records: the kind of refusal
        return f"refused: {type(err).__name__}"


def new_parameter(model: nn.Module) -> str:
    def add() -> str:
        model.extra = nn.Linear(2, 2)
        del model.extra
        return "added"

    return _outcome(add)


def deep_copy(model: nn.Module) -> Any:
    def copy_it() -> Any:
        duplicate = copy.deepcopy(model)
        return {"class": type(duplicate).__name__, "output": _output(duplicate),
                "independent": duplicate.a.weight is not model.a.weight}

    return _outcome(copy_it)


def double(model: nn.Module, optimizer: torch.optim.Optimizer, user: User) -> Any:
    def convert_and_train() -> Any:
        model.double()
        return {"losses": _train(model, optimizer, user, torch.float64),
                "dtype": str(model.get_parameter("scale").dtype)}

    return _outcome(convert_and_train)


def optimizer_built_before_setup_module(user: User) -> list[float]:
    """`setup_module(model)`, then `setup_optimizers(optimizer)` of an optimizer built before it."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model = user.setup_module(model)
    optimizer = user.setup_optimizers(optimizer)
    model.eval()
    return _train(model, optimizer, user, torch.float32)


def observe(model: Any, optimizer: torch.optim.Optimizer, user: User) -> dict[str, Any]:
    """The user's code: the same for the plain model and the set-up one."""
    observed = structure(model)
    model.eval()
    observed["hooks"] = hooks(model, optimizer, user)
    observed["losses"] = _train(model, optimizer, user, torch.float32)
    observed["trained"] = _output(model)
    observed["full_state_dict"] = {k: v.tolist() for k, v in user.full_state_dict(model).items()}  # rank 0's
    observed.update(assignments(model))
    observed["new_parameter"] = new_parameter(model)
    observed["deepcopy"] = deep_copy(model)
    observed["double"] = double(model, optimizer, user)
    observed["optimizer_built_before_setup_module"] = _outcome(lambda: optimizer_built_before_setup_module(user))
    return observed


def plain() -> dict[str, Any]:
    """The observations on the plain model in one process."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return observe(model, optimizer, User(lambda loss, model: loss.backward(), lambda loss: loss.item()))


def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    """`model_parallel`: the first layer column-wise (its output gathered again), then FSDP2 over
    the data-parallel dimension."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model, device_mesh["tensor_parallel"], {"a": ColwiseParallel(output_layouts=Replicate())})
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _data_share(lite: Any) -> tuple[int, int]:
    """(rank, ranks) among the ranks that hold distinct data (tensor-parallel peers share theirs)."""
    mesh = getattr(lite.strategy, "device_mesh", None)
    if mesh is None:
        return lite.global_rank, lite.world_size
    return mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].size()


class Fidelity(LightningLite):
    def run(self) -> dict[str, Any]:
        plain_model = make_model()
        model, optimizer = self.setup(plain_model, torch.optim.SGD(plain_model.parameters(), lr=LR))
        rank, ranks = _data_share(self)
        user = User(lambda loss, model: self.backward(loss, model=model),
                    lambda loss: self.all_reduce(loss, reduce_op="mean").item(), rank, ranks, self.setup_module,
                    self.setup_optimizers, self.full_state_dict)
        observed = observe(model, optimizer, user)
        observed["is_the_user_object"] = model is plain_model
        return observed


def main(out_dir: Path) -> None:
    kwargs = {}
    name = os.environ.get("LITE_STRATEGY")
    if name == "model_parallel":  # the instance replaces the name (set again for the ranks started later)
        from lite_core.strategies import ModelParallelStrategy

        del os.environ["LITE_STRATEGY"]
        kwargs["strategy"] = ModelParallelStrategy(parallelize)
    lite = Fidelity(**kwargs)
    if name is not None:
        os.environ["LITE_STRATEGY"] = name
    observed = lite.run()
    if lite.global_rank == 0:
        (out_dir / "result.json").write_text(json.dumps({"observed": observed}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
