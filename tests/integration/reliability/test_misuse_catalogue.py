"""A catalogue of invalid configurations and misuses: each fails at once with one sentence that
names the fix.

One row per mistake: what is done, the error class expected, and a piece of the message that
names the fix. Every row asserts that the error comes within a second and that its message is a
single one-line sentence. Rows that need running processes (a launched `ddp` job) run in a
subprocess with a timeout, so that a missing check fails the row instead of hanging the suite.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lite_core import LightningLite, _registry
from lite_core.errors import (
    BackendNotInstalledError,
    CheckpointError,
    ConfigurationError,
    MisuseError,
    UnknownNameError,
)
from lite_core.precision.precision import Precision
from lite_core.strategies.ddp import DDPStrategy

#: Seconds within which every error must be raised: a hang guard, not a speed check. A row takes
#: milliseconds to a few tenths of a second idle; a mistake caught late would wait out a collective
#: timeout (20 s in the tests, 30 minutes by default) or a launch.
MAX_SECONDS = 10.0
_CLEAN = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
          "GROUP_RANK", "LITE_ACCELERATOR", "LITE_STRATEGY", "LITE_DEVICES", "LITE_NUM_NODES", "LITE_PRECISION",
          "LITE_COLLECTIVE_TIMEOUT", "LITE_FAKE_AVAILABLE", "LITE_GLOBAL_SEED", "TORCHELASTIC_RUN_ID",
          "SLURM_NTASKS", "SLURM_JOB_ID", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "KUBERNETES_PORT")


@dataclass
class Ctx:
    """What a row's action may use: a scratch folder and a way to set environment variables."""

    tmp: Path
    monkeypatch: pytest.MonkeyPatch

    def env(self, **values: str) -> None:
        for name, value in values.items():
            self.monkeypatch.setenv(name, value)


@dataclass(frozen=True)
class Row:
    id: str
    action: Callable[[Ctx], Any]
    error: type[BaseException]
    fix: str


def lite(**kwargs: Any) -> LightningLite:
    return LightningLite(**{"accelerator": "cpu", **kwargs})


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


# -- actions that need a few statements ---------------------------------------------------------------
def setup_twice(ctx: Ctx) -> None:
    one, model = lite(), nn.Linear(2, 1)
    one.setup(model)
    one.setup(model)


def setup_wrapped_model_again(ctx: Ctx) -> None:
    one = lite()
    one.setup(one.setup(nn.Linear(2, 1)))


def optimizers_set_up_twice(ctx: Ctx) -> None:
    one = lite()
    _, optimizer = model_and_optimizer()
    one.setup_optimizers(optimizer)
    one.setup_optimizers(optimizer)


def model_after_its_optimizer(ctx: Ctx) -> None:
    one = lite()
    model, optimizer = model_and_optimizer()
    wrapped = one.setup_optimizers(optimizer)
    one.setup(model, wrapped)


def foreign_optimizer(ctx: Ctx) -> None:
    model, _ = model_and_optimizer()
    other, optimizer = model_and_optimizer()
    lite().setup(model, optimizer)


def backward_before_setup(ctx: Ctx) -> None:
    model = nn.Linear(2, 1)
    lite().backward(model(torch.ones(1, 2)).sum())


def dataloader_twice(ctx: Ctx) -> None:
    one, loader = lite(), DataLoader(range(4))
    one.setup_dataloaders(loader)
    one.setup_dataloaders(loader)


def clip_without_a_bound(ctx: Ctx) -> None:
    one = lite()
    model, optimizer = one.setup(*model_and_optimizer())
    one.clip_gradients(model, optimizer)


def clip_with_both_bounds(ctx: Ctx) -> None:
    one = lite()
    model, optimizer = one.setup(*model_and_optimizer())
    one.clip_gradients(model, optimizer, clip_val=1.0, max_norm=1.0)


def save_then_load_strict(ctx: Ctx) -> None:
    one = lite()
    one.save({"a": 1}, ctx.tmp / "ckpt.pt")
    one.load(ctx.tmp / "ckpt.pt", {"a": 0, "b": 0})


def load_truncated(ctx: Ctx) -> None:
    path = ctx.tmp / "ckpt.pt"
    lite().save({"w": torch.randn(100)}, path)
    path.write_bytes(path.read_bytes()[:100])
    lite().load(path)


def load_foreign(ctx: Ctx) -> None:
    (ctx.tmp / "notes.txt").write_text("not a checkpoint")
    lite().load(ctx.tmp / "notes.txt")


class Pickled:
    """An arbitrary class in a checkpoint: safe loading refuses it."""


def load_pickled_code(ctx: Ctx) -> None:
    torch.save({"obj": Pickled()}, ctx.tmp / "ckpt.pt")
    lite().load(ctx.tmp / "ckpt.pt")


def load_a_pickle_of_other_code(ctx: Ctx) -> None:
    (ctx.tmp / "ckpt.pt").write_bytes(pickle.dumps({"obj": Pickled()}, protocol=2))
    lite().load(ctx.tmp / "ckpt.pt")


def log_to_a_non_logger(ctx: Ctx) -> None:
    lite(loggers="csv")


class NoLoop(LightningLite):
    """A subclass that forgot to override run()."""


ROWS = [
    # -- names -------------------------------------------------------------------------------------
    Row("accelerator typo", lambda c: lite(accelerator="cpux"), UnknownNameError, "did you mean 'cpu'?"),
    Row("strategy typo", lambda c: lite(strategy="dpp"), UnknownNameError, "did you mean 'ddp'?"),
    Row("strategy typo spawn", lambda c: lite(strategy="ddp_spwan"), UnknownNameError, "did you mean 'ddp_spawn'?"),
    Row("precision typo", lambda c: lite(precision="16-mixd"), ConfigurationError, "did you mean '16-mixed'?"),
    Row("precision unknown", lambda c: lite(precision="fp8"), ConfigurationError, "choose one of ['16-mixed'"),
    Row("precision bool", lambda c: lite(precision=True), ConfigurationError, "choose one of"),
    Row("cuda not installed", lambda c: lite(accelerator="cuda"), BackendNotInstalledError, "pip install './packages/lite-core[cuda]' ./packages/lite-cuda"),
    Row("tpu not installed", lambda c: lite(accelerator="tpu"), BackendNotInstalledError, "pip install './packages/lite-core[xla]' ./packages/lite-xla"),
    Row("deepspeed not installed", lambda c: lite(strategy="deepspeed_stage_3"), BackendNotInstalledError,
        "pip install './packages/lite-core[deepspeed]' ./packages/lite-deepspeed"),
    Row("dp not installed", lambda c: lite(strategy="dp"), BackendNotInstalledError, "pip install './packages/lite-core[cuda]' ./packages/lite-cuda"),
    Row("legacy tpu_cores without xla", lambda c: LightningLite(tpu_cores=8), BackendNotInstalledError, "./packages/lite-xla"),
    # -- wrong types -----------------------------------------------------------------------------------
    Row("accelerator of wrong type", lambda c: lite(accelerator=3), ConfigurationError, "pass e.g. accelerator='cpu'"),
    Row("strategy of wrong type", lambda c: lite(strategy=3.5), ConfigurationError, "pass e.g. strategy='ddp'"),
    Row("plugin of wrong type", lambda c: lite(plugins="fp16"), ConfigurationError, "as accelerator=... and strategy=..."),
    Row("strategy passed as plugin", lambda c: lite(plugins=[DDPStrategy()]), ConfigurationError, "strategy=..."),
    Row("two precision plugins", lambda c: lite(plugins=[Precision(), Precision()]), ConfigurationError, "pass only one"),
    Row("logger of wrong type", log_to_a_non_logger, ConfigurationError, "pass a Logger such as CSVLogger"),
    # -- impossible combinations -----------------------------------------------------------------------
    Row("one-process strategy on 2 devices", lambda c: lite(strategy="single_device", devices=2), ConfigurationError,
        "use strategy='ddp'"),
    Row("strategy on a foreign accelerator", lambda c: lite(strategy="fake_single"), ConfigurationError,
        "choose one of ['fake']"),
    Row("precision the accelerator lacks", lambda c: (c.env(LITE_FAKE_AVAILABLE="1"),
                                                      LightningLite(accelerator="fake", precision="16-mixed")),
        ConfigurationError, "choose one of ['32-true', 'bf16-true']"),
    Row("unavailable accelerator", lambda c: (c.env(LITE_FAKE_AVAILABLE="0"), LightningLite(accelerator="fake")),
        ConfigurationError, "use accelerator='auto' or 'cpu'"),
    Row("legacy gpus with another accelerator", lambda c: LightningLite(accelerator="cpu", gpus=2), ConfigurationError,
        "pass only accelerator='cuda'"),
    Row("several nodes without a scheduler", lambda c: lite(devices=1, num_nodes=2), ConfigurationError,
        "export MASTER_ADDR and MASTER_PORT"),
    # -- device and node counts ------------------------------------------------------------------------
    Row("devices 0", lambda c: lite(devices=0), ConfigurationError, "e.g. devices=2"),
    Row("devices negative", lambda c: lite(devices=-3), ConfigurationError, "e.g. devices=2"),
    Row("devices bad string", lambda c: lite(devices="two"), ConfigurationError, "e.g. devices=2"),
    Row("devices empty list", lambda c: lite(devices=[]), ConfigurationError, "e.g. devices=2"),
    Row("devices float", lambda c: lite(devices=1.5), ConfigurationError, "e.g. devices=2"),
    Row("devices bool", lambda c: lite(devices=True), ConfigurationError, "e.g. devices=2"),
    Row("num_nodes 0", lambda c: lite(num_nodes=0), ConfigurationError, "pass a positive integer"),
    Row("num_nodes negative", lambda c: lite(num_nodes=-2), ConfigurationError, "pass a positive integer"),
    Row("num_nodes string", lambda c: lite(num_nodes="2"), ConfigurationError, "pass a positive integer"),
    Row("num_nodes float", lambda c: lite(num_nodes=1.5), ConfigurationError, "pass a positive integer"),
    # -- environment variables -------------------------------------------------------------------------
    Row("LITE_ACCELERATOR typo", lambda c: (c.env(LITE_ACCELERATOR="cpu1"), LightningLite()), UnknownNameError,
        "did you mean 'cpu'?"),
    Row("LITE_STRATEGY typo", lambda c: (c.env(LITE_STRATEGY="ddp-spawn"), LightningLite(accelerator="cpu")),
        UnknownNameError, "did you mean 'ddp_spawn'?"),
    Row("LITE_DEVICES junk", lambda c: (c.env(LITE_DEVICES="-3"), LightningLite(accelerator="cpu")), ConfigurationError,
        "e.g. devices=2"),
    Row("LITE_NUM_NODES junk", lambda c: (c.env(LITE_NUM_NODES="two"), LightningLite()), ConfigurationError,
        "set it to a positive integer"),
    Row("LITE_PRECISION junk", lambda c: (c.env(LITE_PRECISION="half"), LightningLite()), ConfigurationError,
        "choose one of"),
    Row("LITE_COLLECTIVE_TIMEOUT junk", lambda c: (c.env(LITE_COLLECTIVE_TIMEOUT="soon"), lite(strategy="ddp")),
        ConfigurationError, "set it to a number of seconds"),
    Row("strategy timeout negative", lambda c: DDPStrategy(timeout=-5), ConfigurationError, "a positive number of seconds"),
    Row("MASTER_PORT junk", lambda c: (c.env(MASTER_PORT="http"), lite(strategy="ddp", devices=2)), ConfigurationError,
        "unset it to let Lite choose one"),
    Row("MASTER_PORT out of range", lambda c: (c.env(MASTER_PORT="70000"), lite(strategy="ddp", devices=2)),
        ConfigurationError, "unset it to let Lite choose one"),
    Row("LITE_GLOBAL_SEED junk", lambda c: (c.env(LITE_GLOBAL_SEED="abc"), LightningLite.seed_everything()),
        ConfigurationError, "set LITE_GLOBAL_SEED to an integer"),
    # -- models, optimizers, dataloaders ---------------------------------------------------------------
    Row("backward before setup", backward_before_setup, MisuseError, "call setup(model, optimizer) first"),
    Row("setup twice", setup_twice, MisuseError, "set up each model once"),
    Row("setup the wrapped model again", setup_wrapped_model_again, MisuseError, "set up each model once"),
    Row("setup optimizers twice", optimizers_set_up_twice, MisuseError, "set up each optimizer once"),
    Row("setup a model after its optimizer", model_after_its_optimizer, MisuseError, "set up each optimizer once"),
    Row("optimizer of another model", foreign_optimizer, MisuseError, "build it from model.parameters()"),
    Row("setup a non-module", lambda c: lite().setup(lambda x: x), MisuseError, "pass your torch.nn.Module"),
    Row("setup a non-optimizer", lambda c: lite().setup(nn.Linear(2, 1), "sgd"), MisuseError,
        "pass torch.optim.Optimizer objects"),
    Row("setup_optimizers a non-optimizer", lambda c: lite().setup_optimizers(nn.Linear(2, 1)), MisuseError,
        "pass torch.optim.Optimizer objects"),
    Row("setup_dataloaders a list", lambda c: lite().setup_dataloaders([1, 2, 3]), MisuseError,
        "wrap your data in a torch.utils.data.DataLoader"),
    Row("setup_dataloaders twice", dataloader_twice, MisuseError, "set up each dataloader once"),
    Row("setup_dataloaders unknown sharding", lambda c: lite().setup_dataloaders(DataLoader([1]), sharding="eval"),
        MisuseError, "pass one of 'auto', 'training', 'evaluation'"),
    Row("gather_for_metrics a string", lambda c: lite().gather_for_metrics("text"), MisuseError,
        "cannot send a value of type str: pass tensors"),
    Row("gather_for_metrics an object", lambda c: lite().gather_for_metrics({"x": object()}), MisuseError,
        "cannot send a value of type object: pass tensors"),
    Row("no_backward_sync on the raw model", lambda c: lite().no_backward_sync(nn.Linear(2, 1)), MisuseError,
        "needs the model returned by setup()"),
    Row("clip without a bound", clip_without_a_bound, MisuseError, "pass one of them"),
    Row("clip with both bounds", clip_with_both_bounds, MisuseError, "pass one of them"),
    Row("unknown reduce_op", lambda c: lite().all_reduce(torch.ones(1), reduce_op="avg"), MisuseError,
        "use one of ['max', 'mean'"),
    # -- processes -----------------------------------------------------------------------------------------
    Row("run not overridden", lambda c: NoLoop(accelerator="cpu").run(), NotImplementedError, "put your loop in run()"),
    Row("launch without function under ddp_spawn", lambda c: lite(strategy="ddp_spawn", devices=2).launch(),
        MisuseError, "pass a function"),
    Row("setup outside run under ddp", lambda c: lite(strategy="ddp", devices=2).setup(nn.Linear(2, 1)), MisuseError,
        "call it inside run()"),
    Row("dataloaders outside run under ddp", lambda c: lite(strategy="ddp", devices=2).setup_dataloaders(DataLoader(range(4))),
        MisuseError, "call it inside run()"),
    Row("barrier outside run", lambda c: lite(strategy="ddp", devices=2).barrier(), MisuseError, "call it inside run()"),
    Row("all_reduce outside run", lambda c: lite(strategy="ddp_spawn", devices=2).all_reduce(torch.ones(1)), MisuseError,
        "call it inside run()"),
    Row("all_gather outside run", lambda c: lite(strategy="ddp_fork", devices=2).all_gather(torch.ones(1)), MisuseError,
        "call it inside run()"),
    Row("broadcast outside run", lambda c: lite(strategy="ddp", devices=2).broadcast(1), MisuseError,
        "call it inside run()"),
    Row("save outside run", lambda c: lite(strategy="ddp", devices=2).save({"a": 1}, c.tmp / "a.pt"), MisuseError,
        "call it inside run()"),
    # -- checkpoints ---------------------------------------------------------------------------------------
    Row("load a missing path", lambda c: lite().load(c.tmp / "missing.pt"), CheckpointError, "check the path"),
    Row("load a folder that is no checkpoint", lambda c: lite().load(c.tmp), CheckpointError, "check the path"),
    Row("load a truncated file", load_truncated, CheckpointError, "point load() at a complete checkpoint"),
    Row("load a foreign file", load_foreign, CheckpointError, "point load() at a complete checkpoint"),
    Row("load pickled code", load_pickled_code, CheckpointError, "call load(..., weights_only=False)"),
    Row("load a plain pickle of code", load_a_pickle_of_other_code, CheckpointError, "weights_only=False"),
    Row("load strictly with a missing entry", save_then_load_strict, CheckpointError, "load with strict=False"),
]


@pytest.fixture(scope="module", autouse=True)
def _warm_up() -> None:
    """Pay torch's one-off lazy imports (the first optimizer takes a second or two) outside the timing."""
    model, optimizer = model_and_optimizer()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()


@pytest.fixture
def ctx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ctx:
    for name in _CLEAN:
        monkeypatch.delenv(name, raising=False)
    _registry.clear_cache()
    return Ctx(tmp_path, monkeypatch)


def test_the_catalogue_holds_at_least_40_distinct_mistakes() -> None:
    assert len(ROWS) >= 40
    assert len({row.id for row in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_mistake_fails_at_once_in_one_sentence_naming_the_fix(row: Row, ctx: Ctx, one_sentence: Any) -> None:
    started = time.perf_counter()
    with pytest.raises(row.error) as info:
        row.action(ctx)
    seconds = time.perf_counter() - started
    message = str(info.value)
    assert type(info.value).__module__.startswith("lite_core") or row.error is NotImplementedError, repr(info.value)
    one_sentence(message)
    assert row.fix in message
    assert seconds < MAX_SECONDS, f"{seconds:.2f} s"


# -- rows that need a launched job: one subprocess for all of them (one torch import, one
# -- 2-process start), bounded by a timeout -----------------------------------------------------
_IN_A_JOB = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler
    from lite_core import LightningLite

    class Job(LightningLite):
        def run(self, cases):
            return {case: self.attempt(case) for case in cases}  # each case fails before any collective

        def attempt(self, case):
            class Batches(BatchSampler):
                pass

            loader = DataLoader(range(8), batch_sampler=Batches(SequentialSampler(range(8)), 2, False))
            started = time.perf_counter()
            try:
                if case == "custom batch_sampler":
                    self.setup_dataloaders(loader)
                elif case == "collective with an unknown reduce_op":
                    self.all_reduce(torch.ones(1), reduce_op="average")
            except Exception as err:
                return {"error": type(err).__name__, "message": str(err), "seconds": time.perf_counter() - started}
            return {"error": None}

    print("RESULT " + json.dumps(Job(accelerator="cpu", strategy="ddp_fork", devices=2).run(sys.argv[1:])))
    """
)

JOB_ROWS = [
    ("custom batch_sampler", "MisuseError", "replace_sampler=False"),
    ("collective with an unknown reduce_op", "MisuseError", "use one of ['max', 'mean'"),
]


@pytest.fixture(scope="module")
def job_results(run_script: Any, output_of: Any) -> tuple[dict[str, Any], str]:
    """(case -> what rank 0 reported, the job's output): every row of JOB_ROWS in one job."""
    proc = run_script(command=[sys.executable, "-c", _IN_A_JOB, *(row[0] for row in JOB_ROWS)], timeout=45)
    assert proc.returncode == 0, output_of(proc)
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT ")), output_of(proc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "error", "fix"), JOB_ROWS, ids=[row[0] for row in JOB_ROWS])
def test_mistake_inside_a_running_job(case, error, fix, job_results, one_sentence) -> None:
    results, output = job_results
    result = results[case]
    assert result["error"] == error, output
    one_sentence(result["message"])
    assert fix in result["message"]
    assert result["seconds"] < MAX_SECONDS
