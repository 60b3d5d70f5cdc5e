"""The matrix, as data: which strategy, device count and precision each cell runs, what it needs
installed, and how close to plain PyTorch it must land.

A cell whose backend is not installed here is skipped with a reason that names the missing
distribution; detection reads package metadata and Lite's entry points, it imports no backend.
A backend environment (`LITE_MATRIX_FOCUS=deepspeed`, set by its hatch environment) runs the
cells of its backend and the `everywhere` cells; the `test` environment (no focus) runs every
cell that is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import PackageNotFoundError, distribution, entry_points

#: Tolerances (absolute, on every loss and weight) against plain PyTorch doing the same precision
#: (`reference.py`). Each is below the gap between that precision and the next wider one on this
#: scenario, so a run that silently computes in another precision fails:
#: fp64 vs fp32 3.6e-7, bf16 autocast vs fp32 3.5e-3, bf16 weights vs fp32 5.4e-3.
#: The reference splits each global batch as the ranks do and averages their gradients as DDP
#: does, so lite-core's cells (one process or two over gloo, any precision) are equal bit for bit.
BITWISE = 0.0
EXACT = 1e-6        # 32-true through fairscale's unbucketed reduction; checkpoint moves
FLOAT32 = 1e-5      # 32-true through DeepSpeed's or XLA's own kernels and reductions
BF16_DEEPSPEED = 5e-3  # DeepSpeed keeps bf16 weights (its own bf16 mode, not autocast): vs autocast

#: backend -> (distributions it needs, the hatch environment that has them)
BACKENDS: dict[str, tuple[tuple[str, ...], str]] = {
    "fairscale": (("fairscale",), "test-fairscale"),
    "deepspeed": (("lite-deepspeed", "deepspeed"), "test-deepspeed"),
    "xla": (("lite-xla", "torch-xla"), "test-xla"),
    "cuda": (("lite-cuda",), "test-cuda"),
}


@dataclass(frozen=True)
class Cell:
    """One strategy x device count x precision, trained by `scenario.py`."""

    strategy: str
    devices: int = 1
    precision: str = "32-true"
    accelerator: str = "cpu"
    backend: str | None = None   # a key of BACKENDS; None: lite-core alone
    tolerance: float = BITWISE
    timeout: int = 120           # seconds for one run of the scenario
    everywhere: bool = False     # also run in the backend environments
    xfail: str | None = None     # the known reason it fails (pytest.mark.xfail(strict=True))
    #: How every rank's process must have been started (see scenario.PROCESS_KINDS); None: as
    #: the strategy's launcher starts them (`launched_as`).
    processes: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def id(self) -> str:
        where = "" if self.accelerator == "cpu" else f"{self.accelerator}-"
        return f"{where}{self.strategy}-{self.devices}-{self.precision}"

    @property
    def ran_as(self) -> str:
        """The strategy name that must have run (what `auto` resolves to, for those cells)."""
        if self.strategy != "auto":
            return self.strategy
        return {"tpu": "single_xla"}.get(self.accelerator, "single_device")

    @property
    def launched_as(self) -> str:
        """How the ranks' processes must have been started."""
        if self.processes is not None:
            return self.processes
        spawned = {"ddp_spawn": "SpawnProcess", "ddp_fork": "ForkProcess", "xla": "SpawnProcess",
                   "xla_fsdp": "SpawnProcess"}  # torch-xla starts its replicas with spawn
        return spawned.get(self.ran_as, "MainProcess")

    def env(self) -> dict[str, str]:
        """The variables that choose this cell's constructor arguments in `scenario.py`."""
        env = {"LITE_ACCELERATOR": self.accelerator, "LITE_DEVICES": str(self.devices),
               "LITE_PRECISION": self.precision, **self.extra_env}
        if self.strategy != "auto":
            env["LITE_STRATEGY"] = self.strategy
        return env


_XLA_ENV = {"PJRT_DEVICE": "CPU"}
_XLA_REPLICAS_ENV = {**_XLA_ENV, "LITE_XLA_CPU_HARNESS": "1"}

CELLS: list[Cell] = [
    # lite-core on the CPU, every precision on one process and over 2
    Cell("single_device", everywhere=True),
    *[Cell("single_device", precision=p) for p in ("64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")],
    Cell("ddp", 2, everywhere=True),
    *[Cell("ddp", 2, precision=p) for p in ("64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")],
    Cell("ddp_spawn", 2),
    Cell("ddp_fork", 2),
    Cell("fsdp", 2),
    Cell("fsdp", 2, precision="bf16-mixed"),
    # tensor parallel over 2 processes (dp1 x tp2): the row-wise layer sums partial products, so
    # float32 parity rather than bits
    Cell("model_parallel", 2, tolerance=FLOAT32),
    Cell("ddp_sharded", 2, backend="fairscale", tolerance=EXACT),
    # lite-deepspeed (the offload presets train to the same parity in lite-deepspeed's own tests;
    # each DeepSpeed start costs 15-25 s here, so the matrix keeps one cell per stage)
    Cell("deepspeed_stage_1", 2, backend="deepspeed", tolerance=FLOAT32, timeout=240),
    Cell("deepspeed_stage_2", 2, backend="deepspeed", tolerance=FLOAT32, timeout=240),
    Cell("deepspeed_stage_3", 2, backend="deepspeed", tolerance=FLOAT32, timeout=240),
    Cell("deepspeed_stage_2", 2, precision="bf16-mixed", backend="deepspeed", tolerance=BF16_DEEPSPEED, timeout=240),
    # lite-xla on XLA's CPU device (several replicas through the test-only CPU harness)
    Cell("auto", 1, accelerator="tpu", backend="xla", tolerance=FLOAT32, timeout=180, extra_env=_XLA_ENV),
    Cell("xla", 2, accelerator="tpu", backend="xla", tolerance=FLOAT32, timeout=180, extra_env=_XLA_REPLICAS_ENV),
    Cell("xla_fsdp", 2, accelerator="tpu", backend="xla", tolerance=FLOAT32, timeout=180,
         extra_env=_XLA_REPLICAS_ENV),
    # lite-cuda, when a CUDA device is visible
    Cell("auto", 1, accelerator="cuda", backend="cuda", tolerance=FLOAT32),
    Cell("auto", 1, accelerator="cuda", precision="bf16-mixed", backend="cuda", tolerance=BF16_DEEPSPEED),
    Cell("ddp", 2, accelerator="cuda", backend="cuda", tolerance=FLOAT32),
]

BY_ID: dict[str, Cell] = {cell.id: cell for cell in CELLS}
assert len(BY_ID) == len(CELLS), "two cells share an id"


@dataclass(frozen=True)
class Resume:
    """Save under one cell (after SAVE_AT steps), resume under another, train to the end."""

    saved_by: Cell
    resumed_by: Cell
    #: None: the resumed run continues the uninterrupted one; else a part of Lite's one-sentence error.
    refused: str | None = None

    @property
    def id(self) -> str:
        return f"{self.saved_by.id}-to-{self.resumed_by.id}"


_SINGLE, _DDP, _FSDP = BY_ID["single_device-1-32-true"], BY_ID["ddp-2-32-true"], BY_ID["fsdp-2-32-true"]
_SHARDED = BY_ID["ddp_sharded-2-32-true"]
_MODEL_PARALLEL = BY_ID["model_parallel-2-32-true"]
_ZERO1, _ZERO2 = BY_ID["deepspeed_stage_1-2-32-true"], BY_ID["deepspeed_stage_2-2-32-true"]
_ZERO3 = BY_ID["deepspeed_stage_3-2-32-true"]
_XLA1, _XLA2 = BY_ID["tpu-auto-1-32-true"], BY_ID["tpu-xla-2-32-true"]
#: DeepSpeed checkpoints travel: a ZeRO directory is read whole (model and fp32 Adam state) by the
#: other strategies, and a one-file, fsdp or other-stage ZeRO checkpoint is scattered into ZeRO.

RESUMES: list[Resume] = [
    Resume(_DDP, _SINGLE),
    Resume(_SINGLE, _FSDP),
    Resume(_FSDP, _DDP),
    Resume(_FSDP, _SINGLE),
    Resume(_MODEL_PARALLEL, _SINGLE),
    Resume(_SHARDED, _SINGLE),
    Resume(_SINGLE, _SHARDED),
    Resume(_ZERO2, _ZERO1),
    Resume(_ZERO3, _DDP),
    Resume(_ZERO3, _SINGLE),
    Resume(_ZERO2, _FSDP),
    Resume(_ZERO2, _ZERO3),
    Resume(_ZERO3, _ZERO2),
    Resume(_DDP, _ZERO3),
    Resume(_FSDP, _ZERO2),
    Resume(_XLA2, _DDP),
    Resume(_SINGLE, _XLA2),
    Resume(_XLA2, _XLA1),
]


@cache
def _installed(dist: str) -> bool:
    try:
        distribution(dist)
    except PackageNotFoundError:
        return False
    return True


@cache
def _strategy_names() -> frozenset[str]:
    return frozenset(ep.name for ep in entry_points(group="lite_core.strategies"))


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def skip_reason(cell: Cell, everywhere: bool = True) -> str | None:
    """Why this cell cannot run in this environment, or None if it can. With `everywhere=False`
    (a test that checks Lite itself rather than Lite beside a backend, e.g. the fidelity
    observations) a backend environment runs its own backend's cells only."""
    focus = os.environ.get("LITE_MATRIX_FOCUS")
    if focus and cell.backend != focus and not (cell.everywhere and everywhere):
        return _elsewhere(cell.backend, focus)
    return missing_reason(cell)


def resume_skip_reason(resume: Resume) -> str | None:
    """Why this checkpoint move cannot run here: either side missing, or another environment's."""
    focus = os.environ.get("LITE_MATRIX_FOCUS")
    backends = {resume.saved_by.backend, resume.resumed_by.backend} - {None}
    if focus and focus not in backends:
        return _elsewhere(next(iter(backends), None), focus)
    return missing_reason(resume.saved_by) or missing_reason(resume.resumed_by)


def _elsewhere(backend: str | None, focus: str) -> str:
    # The same words in every backend environment, so that the suite's table has one note per home.
    home = BACKENDS[backend][1] if backend else "test"
    return f"runs in `{home}` (a backend environment runs only its own backend's cells: LITE_MATRIX_FOCUS)"


def missing_reason(cell: Cell) -> str | None:
    """What this environment lacks to run `cell`, or None."""
    if cell.backend is not None:
        dists, home = BACKENDS[cell.backend]
        missing = [d for d in dists if not _installed(d)]
        if missing:
            return f"needs {', '.join(missing)}, not installed in this environment (run it in `{home}`)"
    if cell.strategy != "auto" and cell.strategy not in _strategy_names():
        return f"strategy={cell.strategy!r} is not registered by any installed package"
    if cell.backend == "cuda" and _cuda_devices() < cell.devices:
        return f"needs {cell.devices} CUDA device(s), this machine has {_cuda_devices()}"
    return None
