"""Pipeline parallelism (`ModelParallelStrategy(pipeline_parallel_size=2)`) on 2, 4 or 8 processes,
for comparison with one plain PyTorch process.

    python pipeline_job.py OUT_DIR WORLD_SIZE [CHECKPOINT]

One job runs every layout of its world size, each with its own `LightningLite` in the same processes
(the first launches them; the others reuse them). Every layout trains the same user loop,
`loss = model(x, target=y)`, `backward(loss)`, clipping, `optimizer.step()`, `scheduler.step()`,
for `STEPS` steps, then evaluates under `torch.no_grad()`. Rank 0 writes `OUT_DIR/results.pt` with,
per layout, the initial weights, the final full weights (every stage's, gathered), the losses and
norms that every rank saw, and the evaluation's loss and output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lite_core import LightningLite
from lite_core.errors import LiteError
from lite_core.strategies import ModelParallelStrategy

torch.set_num_threads(1)

GLOBAL_BATCH = 8
STEPS = 3
LR = 0.1
MAX_NORM = 0.3
WIDTH = 8
MICROBATCHES = 4  # the pipeline's default in this job


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Four blocks and a head; a pipeline stage holds some of them (the others are missing)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


class NormNet(Net):
    """`Net` with a BatchNorm before its head: its running statistics are training state that a
    forward pass in training mode changes."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) if self.norm is not None else x
        return self.head(x) if self.head is not None else x


class Transformer(nn.Module):
    """A transformer's shape: embed, blocks (a ModuleList), norm, head. Without split points the
    pipeline cuts the blocks evenly; a stage's forward iterates its own blocks only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) if self.norm is not None else x
        return self.head(x) if self.head is not None else x


def sequential() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(3)), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def parallelize(model: nn.Module, device_mesh) -> nn.Module:
    """The user's function: tensor parallel inside each block, FSDP2 over the data-parallel ranks."""
    tp, dp = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if tp.size() > 1:
        for block in blocks:
            parallelize_module(block, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dp.size() > 1:
        for block in blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return (torch.randn((STEPS + 2) * GLOBAL_BATCH, WIDTH, generator=generator),
            torch.randn((STEPS + 2) * GLOBAL_BATCH, WIDTH, generator=generator))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"net": Net, "norm": NormNet, "transformer": Transformer, "sequential": sequential}[kind]()


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every stage's full weights, on every rank (each process holds its stages' layers)."""
    local = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu().clone()
             for k, v in model.state_dict().items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {k: v for part in gathered for k, v in part.items()}


def this_ranks_batch(lite: LightningLite, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's slice of global batch `step` (every stage of a pipeline gets it)."""
    x, y = make_data()
    rank = lite.strategy.distributed_sampler_kwargs()
    replicas, shard = (rank["num_replicas"], rank["rank"]) if rank else (1, 0)
    per_rank = GLOBAL_BATCH // replicas
    start = step * GLOBAL_BATCH + shard * per_rank
    return lite.to_device(x[start:start + per_rank]), lite.to_device(y[start:start + per_rank])


def training_step(lite: LightningLite, model: nn.Module, optimizer, scheduler, step: int, clip: bool) -> tuple:
    """The user's step: the same under ddp, fsdp and model_parallel with or without a pipeline."""
    xb, yb = this_ranks_batch(lite, step)
    optimizer.zero_grad()
    loss = model(xb, target=yb)
    lite.backward(loss)
    norm = lite.clip_gradients(model, optimizer, max_norm=MAX_NORM).item() if clip else None
    optimizer.step()
    scheduler.step()
    return loss, norm


def the_loop(lite: LightningLite, model: nn.Module, optimizer, scheduler, clip: bool) -> dict:
    """`STEPS` training steps, then an evaluation under `torch.no_grad()`."""
    losses, norms = [], []
    for step in range(STEPS):
        loss, norm = training_step(lite, model, optimizer, scheduler, step, clip)
        norms.append(norm)
        losses.append(lite.all_gather(loss.detach()).cpu())  # every rank's view of the loss
    x, y = make_data()
    per_rank = this_ranks_batch(lite, 0)[0].shape[0]
    with torch.no_grad():
        xb, yb = lite.to_device(x[:per_rank]), lite.to_device(y[:per_rank])
        eval_loss = lite.all_gather(model(xb, target=yb)).cpu()
        output = lite.all_gather(model(xb)).cpu()
    return {"losses": losses, "norms": norms, "eval_loss": eval_loss, "eval_output": output}


def pipeline(world: int, pp: int = 2, dp: int | str = "auto", tp: int = 1, schedule: str = "1F1B",
             microbatches: int = MICROBATCHES, split_points=("blocks.2",), precision: str = "32-true",
             **kwargs) -> LightningLite:
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=dp, tensor_parallel_size=tp,
                                     pipeline_parallel_size=pp, pipeline_schedule=schedule,
                                     microbatches=microbatches,
                                     split_points=list(split_points) if split_points is not None else None,
                                     **kwargs)
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=world, precision=precision)
    lite.launch()
    return lite


def train(lite: LightningLite, kind: str = "net", clip: bool = True) -> dict:
    model = make_model(kind)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = make_optimizer(model)
    model, optimizer = lite.setup(model, optimizer, loss_fn=loss_fn)
    run = the_loop(lite, model, optimizer, scheduler, clip)
    return {**run, "initial": initial, "final": full_weights(model),
            "local_keys": sorted(model.state_dict())}


def other_strategy(world: int, strategy) -> LightningLite:
    lite = LightningLite(accelerator="cpu", strategy=strategy, devices=world)
    lite.launch()
    return lite


def set_up(lite: LightningLite, kind: str = "net") -> dict:
    model = make_model(kind)
    optimizer, scheduler = make_optimizer(model)
    model, optimizer = lite.setup(model, optimizer, loss_fn=loss_fn)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}


def resume_and_step(lite: LightningLite, path: Path, save_to: Path) -> dict:
    """Load `path` into a fresh model, take the next step, save to `save_to`; the full weights."""
    state = set_up(lite)
    lite.load(path, state)
    step = state["step"]
    training_step(lite, state["model"], state["optimizer"], state["scheduler"], step, clip=True)
    lite.save({**state, "step": step + 1}, save_to)
    return {"loaded_step": step, "final": full_weights(state["model"]), "lr": state["scheduler"].get_last_lr()}


def save_on_pipeline(lite: LightningLite, out: Path) -> dict:
    """Train `STEPS` steps under this pipeline layout, save (sharded), and train one step more."""
    state = set_up(lite)
    for step in range(STEPS):
        training_step(lite, state["model"], state["optimizer"], state["scheduler"], step, clip=True)
    lite.save({**state, "step": STEPS}, out / "pp2xdp2_sharded")
    saved = full_weights(state["model"])
    whole = lite.full_state_dict(state["model"])  # every stage's weights on rank 0
    training_step(lite, state["model"], state["optimizer"], state["scheduler"], STEPS, clip=True)
    return {"saved": saved, "one_more": full_weights(state["model"]), "full_state_dict": whole}


def first_batches(lite: LightningLite) -> torch.Tensor:
    """Every rank's first batch from a set-up loader (data is sharded by data-parallel rank only)."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = lite.setup_dataloaders(DataLoader(TensorDataset(torch.arange(16.0)), batch_size=2))
    (batch,) = next(iter(loader))
    return lite.all_gather(batch).cpu()


def error_of(action) -> str:
    try:
        action()
    except LiteError as err:
        return str(err)
    return "no error"


def bad_inputs(world: int) -> dict:
    lite = pipeline(world, split_points=("blocks.9",))
    no_module = error_of(lambda: lite.setup(make_model("net")))
    lite = pipeline(world, schedule="Interleaved1F1B", stages_per_rank=4, split_points=None)
    too_many = error_of(lambda: lite.setup(make_model("net")))
    lite = pipeline(world, microbatches=3)
    model = lite.setup(make_model("net"), loss_fn=loss_fn)
    uneven = error_of(lambda: model(lite.to_device(torch.zeros(4, WIDTH)), target=lite.to_device(torch.zeros(4, WIDTH))))
    lite = pipeline(world)
    model = lite.setup(make_model("net"), loss_fn=loss_fn)
    no_target = error_of(lambda: model(lite.to_device(torch.zeros(4, WIDTH))))
    loss = model(lite.to_device(torch.zeros(4, WIDTH)), target=lite.to_device(torch.ones(4, WIDTH)))
    other_tensor = error_of(lambda: lite.backward(loss.detach() * 2))  # not computed from the loss
    model.eval()  # evaluation without torch.no_grad(): forward only, no gradients left behind
    eval_mode = model(lite.to_device(torch.zeros(4, WIDTH)), target=lite.to_device(torch.ones(4, WIDTH)))
    left_behind = sum(p.grad is not None for p in model.parameters())
    return {"no_module": no_module, "too_many": too_many, "uneven": uneven, "no_target": no_target,
            "other_tensor": other_tensor, "eval_mode_loss": eval_mode.item(), "eval_mode_grads": left_behind}


#: Batches of shrinking sizes under microbatches=2 (each trained on, then evaluated), then 8 again.
SIZES = (8, 4, 2)
#: An epoch's batches (its last one short) and the validation batch, under microbatches=2.
EPOCH = (8, 8, 4)
VALIDATION = 4
EPOCHS = 3


def rank_slice(lite: LightningLite, data: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """This data-parallel rank's part of the global batch `data[start:start + size]`."""
    kwargs = lite.strategy.distributed_sampler_kwargs()
    replicas, shard = (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)
    per_rank = size // replicas
    return lite.to_device(data[start + shard * per_rank:start + (shard + 1) * per_rank])


def step_on(lite: LightningLite, model: nn.Module, optimizer, scheduler, xb: torch.Tensor,
            yb: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(xb, target=yb)
    lite.backward(loss)
    optimizer.step()
    scheduler.step()
    return loss


def shrinking_batches(lite: LightningLite) -> dict:
    """Train on a batch of 8, then 4, then 2, each followed by an evaluation of the same batch under
    `torch.no_grad()` (its output and loss); then evaluate a batch of 8 again."""
    model = make_model("net")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = make_optimizer(model)
    model, optimizer = lite.setup(model, optimizer, loss_fn=loss_fn)
    x, y = make_data()
    losses, outputs, eval_losses, start = [], [], [], 0
    for size in (*SIZES, None):
        if size is not None:
            xb, yb = lite.to_device(x[start:start + size]), lite.to_device(y[start:start + size])
            start += size
            losses.append(lite.all_gather(step_on(lite, model, optimizer, scheduler, xb, yb).detach()).cpu())
        else:
            xb, yb = lite.to_device(x[:SIZES[0]]), lite.to_device(y[:SIZES[0]])
        with torch.no_grad():
            outputs.append(lite.all_gather(model(xb)).cpu())
            eval_losses.append(lite.all_gather(model(xb, target=yb)).cpu())
    return {"initial": initial, "losses": losses, "outputs": outputs, "eval_losses": eval_losses,
            "final": full_weights(model)}


def evaluation(lite: LightningLite, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The user's evaluation between epochs: under `model.eval()` and `torch.no_grad()` the loss and
    the output, then under `model.eval()` alone the loss; whether the gradients (those of the
    epoch's last step) and the random state came out unchanged."""
    xv, yv = rank_slice(lite, x, 0, VALIDATION), rank_slice(lite, y, 0, VALIDATION)
    # Each rank's own shard: torch.equal on a DTensor (FSDP2's gradients) is a collective of its
    # mesh, which all() stopping early on one rank would leave the others waiting in.
    grads = [None if p.grad is None else _local(p.grad).clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    model.eval()
    with torch.no_grad():
        loss = model(xv, target=yv)
        output = model(xv)
    eval_mode_loss = model(xv, target=yv)
    model.train()
    kept = all((a is None and p.grad is None) or (a is not None and p.grad is not None and torch.equal(a, _local(p.grad)))
               for a, p in zip(grads, model.parameters()))
    return {"loss": lite.all_gather(loss.detach()).cpu(), "eval_mode_loss": lite.all_gather(eval_mode_loss.detach()).cpu(),
            "output": lite.all_gather(output.detach()).cpu(), "target": lite.all_gather(yv).cpu(),
            "unchanged": kept and torch.equal(rng, torch.get_rng_state())}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def epochs(lite: LightningLite, evaluate: bool) -> dict:
    """`EPOCHS` epochs of `EPOCH`'s batches (the last one short), with or without an evaluation of a
    batch of `VALIDATION` between them; the final weights and buffers of every stage."""
    model = make_model("norm")
    optimizer, scheduler = make_optimizer(model)
    model, optimizer = lite.setup(model, optimizer, loss_fn=loss_fn)
    x, y = make_data()
    evaluations = []
    for epoch in range(EPOCHS):
        start = 0
        for size in EPOCH:
            step_on(lite, model, optimizer, scheduler, rank_slice(lite, x, start, size), rank_slice(lite, y, start, size))
            start += size
        # Between epochs (ddp's evaluation after the last one would leave rank 0's BatchNorm
        # statistics on every rank: DistributedDataParallel broadcasts buffers at each forward).
        if evaluate and epoch < EPOCHS - 1:
            evaluations.append(evaluation(lite, model, x[start:], y[start:]))
    return {"final": full_weights(model), "evaluations": evaluations}


def evaluation_between_epochs(make_lite) -> dict:
    """The same training with and without an evaluation each epoch."""
    return {"with": epochs(make_lite(), evaluate=True), "without": epochs(make_lite(), evaluate=False)}


def main(out: Path, world: int, checkpoint: Path | None) -> None:
    results: dict = {}
    if world == 2 and checkpoint is not None:
        # A checkpoint of PP2 x DP2 resumed under ddp, whose one file resumes under PP2, and back.
        results["from_pp2xdp2_on_ddp"] = resume_and_step(other_strategy(world, "ddp"), checkpoint, out / "ddp.pt")
        results["from_ddp_on_pp2"] = resume_and_step(pipeline(world), out / "ddp.pt", out / "pp2_sharded")
    if world == 2:
        same_loop = {"ddp": "ddp", "fsdp": "fsdp",
                     "model_parallel_2d": ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)}
        for name, strategy in same_loop.items():
            results[name] = train(other_strategy(world, strategy))
        for schedule in ("GPipe", "1F1B"):
            results[f"pp2_{schedule}"] = train(pipeline(world, schedule=schedule))
        results["pp2_Interleaved1F1B"] = train(pipeline(world, schedule="Interleaved1F1B",
                                                        split_points=("blocks.1", "blocks.2", "blocks.3")))
        results["pp2_sequential"] = train(pipeline(world, schedule="GPipe", split_points=None), kind="sequential",
                                        clip=False)
        results["pp2_transformer"] = train(pipeline(world, split_points=None), kind="transformer")
        for precision in ("bf16-mixed", "bf16-true"):
            results[f"pp2_{precision}"] = train(pipeline(world, precision=precision), clip=False)
        results["shrinking_batches"] = shrinking_batches(pipeline(world, microbatches=2))
        results["epochs_pp2"] = evaluation_between_epochs(lambda: pipeline(world, microbatches=2))
        results["epochs_ddp"] = evaluation_between_epochs(lambda: other_strategy(world, "ddp"))
        results["errors"] = bad_inputs(world)
    elif world == 4:
        results["pp2xdp2_1F1B"] = train(pipeline(world, dp=2))
        results["checkpoint"] = save_on_pipeline(pipeline(world, dp=2), out)
        # The same layout resumes its own shards (the checkpoint holds every stage's keys and groups).
        results["from_pp2xdp2_on_pp2xdp2"] = resume_and_step(pipeline(world, dp=2), out / "pp2xdp2_sharded",
                                                             out / "pp2xdp2_again")
        results["first_batches"] = first_batches(pipeline(world, dp=2))
        results["pp2xdp2_Interleaved1F1B"] = train(pipeline(world, dp=2, schedule="Interleaved1F1B",
                                                            split_points=("blocks.1", "blocks.2", "blocks.3")))
        results["pp2xtp2_GPipe"] = train(pipeline(world, dp=1, tp=2, schedule="GPipe"))
        # The transformer's shape (embed, blocks, norm, head), cut without split points, under both.
        results["pp2xdp2_transformer"] = train(pipeline(world, dp=2, split_points=None), kind="transformer")
        results["pp2xtp2_transformer"] = train(pipeline(world, dp=1, tp=2, split_points=None), kind="transformer")
        # One micro-batch each: a data-parallel rank's half of the short batch (2 rows) would leave
        # BatchNorm one row per micro-batch, which it refuses in training.
        results["epochs_pp2xdp2"] = evaluation_between_epochs(
            lambda: pipeline(world, dp=2, schedule="GPipe", microbatches=1))
        results["epochs_pp2xtp2"] = evaluation_between_epochs(lambda: pipeline(world, dp=1, tp=2, microbatches=2))
    else:
        results["pp2xdp2xtp2_1F1B"] = train(pipeline(world, dp=2, tp=2, microbatches=2))
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
