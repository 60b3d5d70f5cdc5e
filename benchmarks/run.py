"""Benchmark Lite against plain PyTorch in the same run, interleaved, and report the ratios.

    /work/venv/bin/python benchmarks/run.py            # full run (a few minutes)
    /work/venv/bin/python benchmarks/run.py --quick    # short run (under 2 minutes)
    /work/venv/bin/python benchmarks/run.py --only steps,import

Every measurement alternates plain and Lite repetitions and compares medians. The Markdown table
is printed and written to benchmarks/results/latest.md; the raw numbers go to latest.json.
See benchmarks/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import bootstrap_ratio_ci, clean_env, ratio_of_medians  # noqa: E402

SECTIONS = ("steps", "loader", "loader_position", "compile", "ddp", "tp", "fsdp", "deepspeed", "checkpoint", "monitor", "import", "launch",
            "restart", "memory", "recompute", "fp8")
IMPORT_PLAIN = "import torch"
IMPORT_LITE = "import torch, lite_core; from lite_core import LightningLite"


class BenchmarkError(RuntimeError):
    """A benchmark child failed or timed out."""


@dataclass(frozen=True)
class StepPlan:
    """Repetitions for one step-timing job: per model, rounds, timed steps per block, warm-up steps."""

    models: tuple[str, ...]
    reps: tuple[int, ...]
    steps: tuple[int, ...]
    warmup: tuple[int, ...]


@dataclass(frozen=True)
class Config:
    """How much of each measurement to run (`QUICK` or `FULL`)."""

    name: str
    single: StepPlan
    ddp: StepPlan
    tp: StepPlan
    import_reps: int
    importtime_reps: int
    launch_reps: int
    launch_steps: int
    memory_reps: int
    memory_steps: int
    memory_default_allocator: bool
    engine: StepPlan
    checkpoint_reps: int
    monitor: StepPlan
    step_timeout_s: float
    child_timeout_s: float


QUICK = Config(
    name="quick",
    single=StepPlan(("tiny", "mlp2048"), reps=(24, 5), steps=(250, 3), warmup=(200, 2)),
    ddp=StepPlan(("tiny", "mlp1024"), reps=(12, 6), steps=(60, 3), warmup=(30, 1)),
    tp=StepPlan(("mlp512tp",), reps=(8,), steps=(10,), warmup=(5,)),
    import_reps=3, importtime_reps=1, launch_reps=2, launch_steps=10, memory_reps=2, memory_steps=3,
    memory_default_allocator=False,
    engine=StepPlan(("tiny", "mlp1024"), reps=(6, 4), steps=(30, 3), warmup=(10, 1)), checkpoint_reps=3,
    monitor=StepPlan(("tiny",), reps=(12,), steps=(250,), warmup=(200,)),
    step_timeout_s=180, child_timeout_s=90,
)
FULL = Config(
    name="full",
    single=StepPlan(("tiny", "mlp2048"), reps=(40, 15), steps=(500, 5), warmup=(300, 3)),
    ddp=StepPlan(("tiny", "mlp1024"), reps=(20, 10), steps=(200, 6), warmup=(50, 2)),
    tp=StepPlan(("mlp512tp",), reps=(16,), steps=(20,), warmup=(10,)),
    import_reps=12, importtime_reps=4, launch_reps=6, launch_steps=10, memory_reps=4, memory_steps=5,
    memory_default_allocator=True,
    engine=StepPlan(("tiny", "mlp1024"), reps=(40, 12), steps=(60, 4), warmup=(20, 2)), checkpoint_reps=15,
    monitor=StepPlan(("tiny",), reps=(40,), steps=(500,), warmup=(300,)),
    step_timeout_s=420, child_timeout_s=120,
)

#: Largest acceptable Lite/plain ratio per measurement (None: reported without a target).
TARGETS = {"steps:tiny": 1.02, "loader:tiny": 1.02, "compile:tiny": 1.02, "steps:mlp2048": 1.005, "ddp:tiny": 1.02, "ddp:mlp1024": 1.005, "tp:mlp512tp": 1.02,
           "import": 1.05, "import-attrib": 1.05, "launch": 1.2, "memory": None,
           "memory-default-malloc": None,
           **{f"{kind}:{model}": 1.02 for kind in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
              for model in ("tiny", "mlp1024")},
           "checkpoint:save": 1.05, "checkpoint:load": 1.05, "checkpoint:stall": 0.2, "monitor:tiny": 1.02,
           "launch-cli": 1.05, "restart": None, "position:batch": 1.01, "position:calls": None,
           "position:deep-resume": None, "recompute:memory": 0.5, "recompute:step": 1.02,
           "fp8:step": 1.02}


@dataclass
class Row:
    """One line of the results table."""

    key: str
    measurement: str
    unit: str
    plain: float | None = None
    lite: float | None = None
    ratio: float | None = None
    ci: tuple[float, float] | None = None
    control: float | None = None
    target: float | None = None
    reps: int = 0
    note: str = ""
    error: str | None = None

    @property
    def verdict(self) -> str:
        """`meets`, `misses` or `inconclusive` (the 95% interval straddles the target)."""
        if self.error is not None:
            return "error"
        if self.target is None or self.ratio is None:
            return "-"
        low, high = self.ci if self.ci is not None else (self.ratio, self.ratio)
        if high <= self.target:
            return "meets"
        if low > self.target:
            return "misses"
        return "inconclusive (meets at median)" if self.ratio <= self.target else "inconclusive (misses at median)"


@dataclass
class Context:
    """Settings shared by every benchmark function."""

    config: Config
    threads: int
    python: str = sys.executable
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lite-bench-")))
    notes: list[str] = field(default_factory=list)
    load_at_start: tuple[float, float, float] = field(default_factory=os.getloadavg)


# -- child processes ----------------------------------------------------------------------------
def run_child(command: Sequence[str], timeout: float, env: dict[str, str],
              cwd: Path = HERE) -> tuple[float, str, str]:
    """Run `command` in its own session; return (wall seconds, stdout, stderr).

    On timeout the child's whole process group (it may have started ranks) is killed.
    Raises:
        BenchmarkError: the child timed out or exited with a non-zero code.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise BenchmarkError(f"timed out after {timeout:.0f}s: {' '.join(command)}") from None
    except BaseException:  # e.g. Ctrl-C: the child runs in its own session and would outlive us
        _kill_group(proc)
        raise
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise BenchmarkError(f"exit code {proc.returncode}: {' '.join(command)}\n{tail}")
    return elapsed, stdout, stderr


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the process group this benchmark started for `proc` (and only that one)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def child_env(threads: int) -> dict[str, str]:
    """Environment for every child: no inherited launcher variables, fixed threads, short timeouts."""
    return clean_env(LITE_COLLECTIVE_TIMEOUT="60", OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")


# -- per-step benchmarks ------------------------------------------------------------------------
def _plan_args(plan: StepPlan) -> list[str]:
    join = lambda values: ",".join(str(v) for v in values)  # noqa: E731
    return ["--models", join(plan.models), "--reps", join(plan.reps), "--steps", join(plan.steps),
            "--warmup", join(plan.warmup), "--control"]


def step_rows(result: dict[str, Any], section: str, label: str) -> list[Row]:
    """Rows (one per model) from a step worker's JSON: block medians in ns -> µs per step."""
    rows = []
    for name, data in result["models"].items():
        blocks = data["block_medians_ns"]
        plain = [v / 1e3 for v in blocks["plain"]]
        lite = [v / 1e3 for v in blocks["lite"]]
        row = Row(f"{section}:{name}", f"{label}: {data['description']}", "µs/step",
                  plain=statistics.median(plain), lite=statistics.median(lite), ratio=ratio_of_medians(plain, lite),
                  ci=bootstrap_ratio_ci(plain, lite), target=TARGETS.get(f"{section}:{name}"), reps=len(plain))
        if "control" in blocks:
            row.control = ratio_of_medians(plain, [v / 1e3 for v in blocks["control"]])
        row.note = f"{row.lite - row.plain:+.1f} µs/step; {data['reps']}x{data['steps_per_block']} steps per arm"
        rows.append(row)
    return rows


def bench_steps(ctx: Context) -> list[Row]:
    """Measurement 1: per-step time, single process, plain vs Lite (plus A/A control)."""
    out = ctx.workdir / "single.json"
    command = [ctx.python, str(HERE / "_single_worker.py"), "--threads", str(ctx.threads), "--out", str(out),
               *_plan_args(ctx.config.single)]
    run_child(command, ctx.config.step_timeout_s, child_env(ctx.threads))
    result = json.loads(out.read_text())
    ctx.notes.append(f"Timer floor (back-to-back perf_counter_ns): {result['timer_floor_ns']:.0f} ns per reading.")
    return step_rows(result, "steps", f"Step, 1 proc, {result['threads']} thread(s)") + call_rows(ctx, result)


def bench_loader(ctx: Context) -> list[Row]:
    """Measurement 1b: per-step time including the dataloader, plain `DataLoader` vs Lite's set-up one
    (tiny model only: where the data path's per-batch cost shows most)."""
    out = ctx.workdir / "loader.json"
    plan = ctx.config.single
    command = [ctx.python, str(HERE / "_single_worker.py"), "--threads", str(ctx.threads), "--out", str(out),
               "--models", plan.models[0], "--reps", str(plan.reps[0]), "--steps", str(plan.steps[0]),
               "--warmup", str(plan.warmup[0]), "--control", "--loader"]
    run_child(command, ctx.config.step_timeout_s, child_env(ctx.threads))
    result = json.loads(out.read_text())
    label = f"Step incl. set-up dataloader, 1 proc, {result['threads']} thread(s)"
    rows = step_rows(result, "loader", label)
    for name, data in result["models"].items():
        calls = data.get("calls_per_step")
        if calls:
            rows.append(Row(f"loader-calls:{name}", f"Calls per step incl. dataloader (deterministic): {name}",
                            "calls", plain=calls["plain"], lite=calls["lite"], ratio=calls["lite"] / calls["plain"],
                            note=f"{calls['lite'] - calls['plain']:+.0f} calls/step", reps=10))
    return rows


def bench_loader_position(ctx: Context) -> list[Row]:
    """Measurement 1d: the set-up loader's global position (`_position_worker.py`): its cost per
    batch against a plain shuffled `DataLoader`, its calls per batch, and the time `load` takes to
    reach a position 90% into a 1M-sample epoch with `num_workers=2` (first batch included)."""
    out = ctx.workdir / "position.json"
    quick = ctx.config.name == "quick"
    command = [ctx.python, str(HERE / "_position_worker.py"), "--out", str(out), "--reps", "10" if quick else "100",
               "--resume-reps", "2" if quick else "5"]
    run_child(command, ctx.config.step_timeout_s, child_env(1))
    result = json.loads(out.read_text())
    per_batch, deep = result["per_batch"], result["deep_resume"]
    plain_ns, lite_ns = per_batch["ns_per_batch"]["plain"], per_batch["ns_per_batch"]["lite"]
    calls = per_batch["calls_per_batch"]
    rows = [paired_row("position:batch", "Per batch, shuffled DataLoader of a TensorDataset, no model: set-up"
                       " (position kept) vs plain", "µs/batch", [v / 1e3 for v in plain_ns], [v / 1e3 for v in lite_ns]),
            Row("position:calls", "Python calls per batch (deterministic): set-up vs plain", "calls",
                plain=calls["plain"], lite=calls["lite"], ratio=calls["lite"] / calls["plain"],
                note=f"{calls['lite'] - calls['plain']:+.1f} calls/batch")]
    row = paired_row("position:deep-resume", f"load at sample {deep['consumed']:,} of {deep['samples']:,} + first batch"
                     " (num_workers=2) vs a fresh epoch's first batch", "s", deep["plain_first_batch_s"],
                     deep["lite_load_and_first_batch_s"])
    row.note = f"plain PyTorch fetching its way there: {deep['plain_fetch_to_position_s']:.0f} s"
    stream = result["stream_per_batch"]
    plain_ns, lite_ns = stream["ns_per_batch"]["plain"], stream["ns_per_batch"]["lite"]
    calls = stream["calls_per_batch"]
    rows += [paired_row("position:stream-batch", "Per batch, DataLoader over an IterableDataset of tensors, no model:"
                        " set-up (cut into rounds, position kept) vs plain", "µs/batch",
                        [v / 1e3 for v in plain_ns], [v / 1e3 for v in lite_ns]),
             Row("position:stream-calls", "Python calls per batch of a stream (deterministic): set-up vs plain",
                 "calls", plain=calls["plain"], lite=calls["lite"], ratio=calls["lite"] / calls["plain"],
                 note=f"{calls['lite'] - calls['plain']:+.1f} calls/batch")]
    resume = result["stream_resume"]
    times = resume["first_batch_s"]
    for arm, how in (("seek", "a stream that can seek (lite_iter_from)"), ("read", "a stream read and dropped")):
        rows.append(paired_row(f"position:stream-resume-{arm}", f"load at sample {resume['consumed']:,} of"
                               f" {resume['samples']:,} + first batch (num_workers=2), {how}, vs a fresh pass's"
                               " first batch", "s", times["fresh"], times[arm]))
    return rows + [row]


def bench_compile(ctx: Context) -> list[Row]:
    """Measurement 1c: per-step time of a `torch.compile`d model (inductor), compiled plain PyTorch
    vs `lite.setup(torch.compile(model))` (tiny model only: where a wrapper's cost shows most)."""
    out = ctx.workdir / "compile.json"
    plan = ctx.config.single
    command = [ctx.python, str(HERE / "_single_worker.py"), "--threads", str(ctx.threads), "--out", str(out),
               "--models", plan.models[0], "--reps", str(plan.reps[0]), "--steps", str(plan.steps[0]),
               "--warmup", str(plan.warmup[0]), "--control", "--compile"]
    run_child(command, ctx.config.step_timeout_s, child_env(ctx.threads))
    result = json.loads(out.read_text())
    return step_rows(result, "compile", f"Compiled step (torch.compile, inductor), 1 proc, {result['threads']} thread(s)")


def call_rows(ctx: Context, result: dict[str, Any], kind: str = "") -> list[Row]:
    """Deterministic rows: function calls per step, plain vs Lite (the wrappers' extra Python work);
    `kind` names the strategy in the rows' keys and labels (none: the single-process rows)."""
    rows = []
    prefix, where = (f"{kind}-", f"{kind}, rank 0, ") if kind else ("", "")
    for name, data in result["models"].items():
        calls = data.get("calls_per_step")
        if not calls:
            continue
        extra = data["extra_lite_calls_per_step"]
        rows.append(Row(f"{prefix}calls:{name}", f"Calls per step (deterministic, sys.setprofile): {where}{name}",
                        "calls", plain=calls["plain"], lite=calls["lite"], ratio=calls["lite"] / calls["plain"],
                        note=f"{calls['lite'] - calls['plain']:+.0f} calls/step", reps=10))
        if len(rows) == 1:
            listing = ", ".join(f"{fn} x{count:g}" if count != 1 else fn for fn, count in extra.items())
            ctx.notes.append(f"Extra calls in one Lite step ({where}{name}): {listing}.")
    return rows


def bench_ddp(ctx: Context) -> list[Row]:
    """Measurement 2: per-step time on 2 processes, plain DDP vs Lite DDP (plus A/A control)."""
    out = ctx.workdir / "ddp.json"
    command = [ctx.python, str(HERE / "_ddp_worker.py"), "--threads", "1", "--out", str(out),
               *_plan_args(ctx.config.ddp)]
    run_child(command, ctx.config.step_timeout_s, child_env(1))
    return step_rows(json.loads(out.read_text()), "ddp", "Step, 2-proc DDP (gloo), rank 0")


def bench_tp(ctx: Context) -> list[Row]:
    """Measurement 2b: per-step time on 4 processes (dp2 x tp2), a hand-written tensor-parallel x
    FSDP2 loop vs the same model through `ModelParallelStrategy` (plus A/A control)."""
    out = ctx.workdir / "tp.json"
    command = [ctx.python, str(HERE / "_tp_worker.py"), "--threads", "1", "--out", str(out),
               *_plan_args(ctx.config.tp)]
    run_child(command, ctx.config.step_timeout_s, child_env(1))
    return step_rows(json.loads(out.read_text()), "tp", "Step, 4-proc tensor parallel x FSDP2 (gloo), rank 0")


def _engine_rows(ctx: Context, kind: str, python: str) -> list[Row]:
    out = ctx.workdir / f"{kind}.json"
    plan = ctx.config.engine
    command = [python, str(HERE / "_engine_worker.py"), "--kind", kind, "--out", str(out), *_plan_args(plan)]
    env = child_env(1)
    env.update(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
    run_child(command, ctx.config.step_timeout_s, env)
    label = {"fsdp": "Step, 2-proc fsdp vs hand-written fully_shard"}.get(
        kind, f"Step, 2-proc {kind} vs hand-written DeepSpeed engine loop")
    result = json.loads(out.read_text())
    return step_rows(result, kind, f"{label}, rank 0") + call_rows(ctx, result, kind)


def bench_fsdp(ctx: Context) -> list[Row]:
    """Measurement 2b: per-step time on 2 processes, hand-written FSDP2 (`fully_shard`) vs Lite's `fsdp`."""
    return _engine_rows(ctx, "fsdp", ctx.python)


def bench_deepspeed(ctx: Context) -> list[Row]:
    """Measurement 2c: per-step time on 2 CPU processes, a hand-written DeepSpeed engine loop vs
    Lite's `deepspeed_stage_2` and `deepspeed_stage_3` (needs deepspeed: `hatch run bench:all` installs it)."""
    found = run_child([ctx.python, "-c", "import importlib.util as u; print(bool(u.find_spec('deepspeed')"
                       " and u.find_spec('lite_deepspeed')))"], ctx.config.child_timeout_s, child_env(1))[1]
    if found.strip() != "True":
        raise BenchmarkError("deepspeed or lite-deepspeed is not installed in this Python: run `hatch run bench:all`"
                             " (its install step builds them) or `hatch run bench:install` first")
    return _engine_rows(ctx, "deepspeed_stage_2", ctx.python) + _engine_rows(ctx, "deepspeed_stage_3", ctx.python)


def bench_checkpoint(ctx: Context) -> list[Row]:
    """Measurement 6: save and load of a 200 MB state vs torch, and the stall of a background save."""
    out = ctx.workdir / "checkpoint.json"
    command = [ctx.python, str(HERE / "_checkpoint_worker.py"), "--reps", str(ctx.config.checkpoint_reps),
               "--dir", str(ctx.workdir), "--out", str(out)]
    run_child(command, ctx.config.step_timeout_s, child_env(1))
    result = json.loads(out.read_text())
    size = f"{result['megabytes']:.0f} MB"
    labels = {
        "save": f"save, {size} model+SGD state: `lite.save` vs `torch.save(state_dicts)`",
        "load": f"load, {size}: `lite.load(path, state)` vs `torch.load` + `load_state_dict` x2",
        "stall": f"Training stall per save, {size}: `save(blocking=False)` vs blocking `save`",
    }
    rows = []
    for name, arms in result["seconds"].items():
        row = paired_row(f"checkpoint:{name}", labels[name], "s", arms["plain"], arms["lite"],
                         note=f"{statistics.median(arms['lite']) - statistics.median(arms['plain']):+.3f} s")
        if "control" in arms:
            row.control = ratio_of_medians(arms["plain"], arms["control"])
        rows.append(row)
    return rows


def bench_monitor(ctx: Context) -> list[Row]:
    """Measurement 7: the per-step cost of `ThroughputMonitor.step()` on the tiny model."""
    out = ctx.workdir / "monitor.json"
    plan = ctx.config.monitor
    command = [ctx.python, str(HERE / "_monitor_worker.py"), "--reps", str(plan.reps[0]), "--steps",
               str(plan.steps[0]), "--warmup", str(plan.warmup[0]), "--out", str(out)]
    run_child(command, ctx.config.step_timeout_s, child_env(1))
    return step_rows(json.loads(out.read_text()), "monitor", "Step + ThroughputMonitor.step() vs plain step, 1 proc")


# -- import time ----------------------------------------------------------------------------------
def interleave(reps: int, plain: Callable[[], float], lite: Callable[[], float]) -> tuple[list[float], list[float]]:
    """Call `plain` and `lite` `reps` times each, alternating which goes first (ABBA...)."""
    plain_values, lite_values = [], []
    for rep in range(reps):
        order = ((plain, plain_values), (lite, lite_values))
        for fn, values in order if rep % 2 == 0 else reversed(order):
            values.append(fn())
    return plain_values, lite_values


def paired_row(key: str, measurement: str, unit: str, plain: list[float], lite: list[float], note: str = "") -> Row:
    """A row from paired repetitions: medians, ratio of medians and its bootstrap interval."""
    return Row(key, measurement, unit, plain=statistics.median(plain), lite=statistics.median(lite),
               ratio=ratio_of_medians(plain, lite), ci=bootstrap_ratio_ci(plain, lite) if len(plain) > 1 else None,
               target=TARGETS.get(key),
               reps=len(plain), note=note)


def bench_import(ctx: Context) -> list[Row]:
    """Measurement 3: wall time of fresh `python -c` imports, plus `-X importtime` attribution."""
    env = child_env(ctx.threads)
    timeout = ctx.config.child_timeout_s

    def timed(code: str) -> Callable[[], float]:
        return lambda: run_child([ctx.python, "-c", code], timeout, env, cwd=ctx.workdir)[0] * 1e3

    run_child([ctx.python, "-c", IMPORT_LITE], timeout, env, cwd=ctx.workdir)  # warm the file cache
    plain, lite = interleave(ctx.config.import_reps, timed(IMPORT_PLAIN), timed(IMPORT_LITE))
    rows = [paired_row("import", "Import, fresh process: `import torch` vs + `from lite_core import LightningLite`",
                       "ms", plain, lite, note=f"{statistics.median(lite) - statistics.median(plain):+.0f} ms "
                       "(includes interpreter start-up in both)")]
    torch_ms, lite_ms = [], []
    for _ in range(ctx.config.importtime_reps):
        torch_cost, extra = importtime_split(ctx)
        torch_ms.append(torch_cost)
        lite_ms.append(torch_cost + extra)
    extra_median = statistics.median(b - a for a, b in zip(torch_ms, lite_ms))
    rows.append(paired_row("import-attrib", "Import, `-X importtime` attribution (torch vs torch + what Lite adds)",
                           "ms", torch_ms, lite_ms, note=f"Lite's own imports: {extra_median:.1f} ms"))
    return rows


def importtime_split(ctx: Context) -> tuple[float, float]:
    """(ms to import torch, ms of everything imported after it) from one `-X importtime` run."""
    _, _, stderr = run_child([ctx.python, "-X", "importtime", "-c", IMPORT_LITE], ctx.config.child_timeout_s,
                             child_env(ctx.threads), cwd=ctx.workdir)
    torch_us, after_us, seen_torch = 0, 0, False
    for line in stderr.splitlines():
        parts = line.split("|")
        if not line.startswith("import time:") or len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name_field = parts[2]
        top_level = len(name_field) - len(name_field.lstrip(" ")) == 1
        if not top_level:
            continue
        cumulative = int(parts[1])
        if name_field.strip() == "torch":
            torch_us, seen_torch = cumulative, True
        elif seen_torch:
            after_us += cumulative
    if not seen_torch:
        raise BenchmarkError("`-X importtime` output had no top-level torch entry")
    return torch_us / 1e3, after_us / 1e3


# -- launch to exit -------------------------------------------------------------------------------
def bench_launch(ctx: Context) -> list[Row]:
    """Measurement 4: wall time from launch to exit of a 2-process DDP job, Lite vs torchrun."""
    from lite_core.plugins import find_free_port

    env = child_env(1)
    timeout = ctx.config.child_timeout_s
    steps = ["--steps", str(ctx.config.launch_steps)]

    def lite() -> float:
        return run_child([ctx.python, str(HERE / "_launch_lite.py"), *steps], timeout, env)[0]

    def plain() -> float:
        command = [ctx.python, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                   f"--master-port={find_free_port()}", str(HERE / "_launch_plain.py"), *steps]
        return run_child(command, timeout, env)[0]

    def lite_run() -> float:
        command = [ctx.python, "-m", "lite_core.cli", "run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                   f"--master-port={find_free_port()}", str(HERE / "_launch_plain.py"), *steps]
        return run_child(command, timeout, env)[0]

    plain_s, lite_s = interleave(ctx.config.launch_reps, plain, lite)
    torchrun_s, cli_s = interleave(ctx.config.launch_reps, plain, lite_run)
    return [paired_row("launch", "Launch-to-exit, 2-proc DDP: `python lite_script.py` vs `torchrun --nproc-per-node=2`",
                       "s", plain_s, lite_s, note=f"{ctx.config.launch_steps} tiny steps per rank; "
                       f"{statistics.median(lite_s) - statistics.median(plain_s):+.2f} s"),
            paired_row("launch-cli", "Launch-to-exit, the same plain 2-proc script: `lite run --nproc-per-node=2` vs"
                       " `torchrun --nproc-per-node=2`", "s", torchrun_s, cli_s,
                       note=f"{statistics.median(cli_s) - statistics.median(torchrun_s):+.2f} s")]


# -- restart ---------------------------------------------------------------------------------------
def bench_restart(ctx: Context) -> list[Row]:
    """Measurement 4b: seconds from a worker's death to every worker training again, under
    `lite run --max-restarts 1` vs `torchrun --max-restarts 1` (the same Lite script)."""
    env = child_env(1)
    timeout = ctx.config.child_timeout_s

    def recovery(launcher: list[str]) -> Callable[[], float]:
        def fn() -> float:
            with tempfile.TemporaryDirectory(dir=ctx.workdir) as out:
                run_child([*launcher, "--nproc-per-node=2", "--max-restarts=1", str(HERE / "_restart_job.py"), out],
                          timeout, env)
                died = float(Path(out, "died_at").read_text())
                return max(float(p.read_text()) for p in Path(out).glob("trained_rank*")) - died
        return fn

    torchrun = recovery([ctx.python, "-m", "torch.distributed.run", "--standalone"])
    lite_run = recovery([ctx.python, "-m", "lite_core.cli", "run"])
    plain_s, lite_s = interleave(ctx.config.launch_reps, torchrun, lite_run)
    return [paired_row("restart", "Worker death to every worker training again, 2 procs, `--max-restarts 1`:"
                       " `lite run` vs `torchrun --standalone`", "s", plain_s, lite_s,
                       note="goal: Lite <= 10 s; the same Lite script under both")]


# -- memory ----------------------------------------------------------------------------------------
def bench_memory(ctx: Context) -> list[Row]:
    """Measurement 5: peak RSS of the single-process compute-bound loop, plain vs Lite.

    glibc's malloc moves its mmap threshold as large blocks are freed, which makes the peak RSS of
    the same loop jump by ~10 MiB from run to run. The main row pins the threshold
    (`MALLOC_MMAP_THRESHOLD_`), which makes the peak repeatable to ~0.2 MiB; the full run adds a
    row with the default allocator, as a user's process would run.
    """
    rows = [_memory_row(ctx, "memory", pinned=True)]
    if ctx.config.memory_default_allocator:
        rows.append(_memory_row(ctx, "memory-default-malloc", pinned=False))
    return rows


def _memory_row(ctx: Context, key: str, pinned: bool) -> Row:
    env = child_env(ctx.threads)
    if pinned:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    model = ctx.config.single.models[-1]
    setup: dict[str, list[float]] = {"plain": [], "lite": []}

    def measure(arm: str) -> Callable[[], float]:
        def fn() -> float:
            command = [ctx.python, str(HERE / "_memory_worker.py"), "--arm", arm, "--model", model,
                       "--steps", str(ctx.config.memory_steps), "--threads", str(ctx.threads)]
            report = json.loads(run_child(command, ctx.config.child_timeout_s, env)[1].strip().splitlines()[-1])
            setup[arm].append(report["setup_rss_mib"])
            return float(report["peak_rss_mib"])
        return fn

    plain, lite = interleave(ctx.config.memory_reps, measure("plain"), measure("lite"))
    delta = statistics.median(lite) - statistics.median(plain)
    setup_delta = statistics.median(setup["lite"]) - statistics.median(setup["plain"])
    allocator = "mmap threshold pinned" if pinned else "default malloc"
    return paired_row(key, f"Peak RSS, 1 proc, {model} loop, {ctx.config.memory_steps} steps ({allocator})", "MiB",
                      plain, lite, note=f"{delta:+.1f} MiB peak; {setup_delta:+.1f} MiB after imports+setup")


def bench_recompute(ctx: Context) -> list[Row]:
    """Recompute under `ddp` on one process, a fresh process per arm and repetition:

    - memory: the peak RSS a process reaches during the steps minus its RSS after set-up (the mmap
      threshold pinned, as in `bench_memory`, so freed activations leave the RSS), without (the
      "plain" column) and with `activation_checkpointing={Block}` ("Lite");
    - step: the median step of Lite's `activation_checkpointing={Block}` against the same job by hand
      (torch's `checkpoint` on each block, `DistributedDataParallel`, no Lite)."""
    env = child_env(ctx.threads)
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    peaks: dict[str, list[float]] = {"without": [], "with": []}

    def report(arm: str, *extra: str) -> dict[str, float]:
        command = [ctx.python, str(HERE / "_recompute_worker.py"), "--arm", arm, "--threads", str(ctx.threads), *extra]
        return json.loads(run_child(command, ctx.config.child_timeout_s, env)[1].strip().splitlines()[-1])

    def memory(arm: str) -> Callable[[], float]:
        def fn() -> float:
            found = report(arm, "--steps", str(ctx.config.memory_steps))
            peaks[arm].append(found["peak_rss_mib"])
            return float(found["peak_rss_mib"] - found["setup_rss_mib"])
        return fn

    def step(arm: str) -> Callable[[], float]:
        return lambda: float(report(arm, "--steps", str(ctx.config.memory_steps), "--warmup", "1")["step_s"])

    without, with_ = interleave(ctx.config.memory_reps, memory("without"), memory("with"))
    by_hand, lite = interleave(ctx.config.memory_reps + 2, step("by-hand"), step("with"))
    model = "8 residual MLP blocks 256-1024-256, batch 2048"
    note = f"peak RSS {statistics.median(peaks['without']):.0f} -> {statistics.median(peaks['with']):.0f} MiB; {model}"
    return [paired_row("recompute:memory", "Memory the steps add, ddp on 1 proc: without vs with recompute", "MiB",
                       without, with_, note=note),
            paired_row("recompute:step", "Recompute step, ddp on 1 proc: torch's checkpoint by hand vs Lite", "s",
                       by_hand, lite, note=f"{model}; median of {ctx.config.memory_steps} steps per process")]


def bench_fp8(ctx: Context) -> list[Row]:
    """FP8 step time on one process: Lite's `Float8Precision("rowwise", emulate=True)` against the
    same loop with torchao's conversion and bf16 autocast by hand, a fresh process per arm and
    repetition (FP8 emulated on the CPU: the ratio is Lite's overhead around torchao)."""
    env = child_env(ctx.threads)

    def measure(arm: str) -> Callable[[], float]:
        def fn() -> float:
            command = [ctx.python, str(HERE / "_fp8_worker.py"), "--arm", arm, "--threads", str(ctx.threads)]
            return float(json.loads(run_child(command, ctx.config.child_timeout_s, env)[1].strip().splitlines()[-1])
                         ["step_s"])
        return fn

    plain, lite = interleave(ctx.config.memory_reps + 2, measure("plain"), measure("lite"))
    return [paired_row("fp8:step", "FP8 step (rowwise, emulated), 1 proc: torchao by hand vs Lite", "s", plain, lite,
                       note="4 residual MLP blocks 512-1024-512, batch 256, median of 5 steps per process")]


BENCHMARKS: dict[str, Callable[[Context], list[Row]]] = {
    "steps": bench_steps, "loader": bench_loader, "loader_position": bench_loader_position, "compile": bench_compile, "ddp": bench_ddp, "tp": bench_tp, "fsdp": bench_fsdp,
    "deepspeed": bench_deepspeed,
    "checkpoint": bench_checkpoint, "monitor": bench_monitor, "import": bench_import,
    "launch": bench_launch, "restart": bench_restart, "memory": bench_memory, "recompute": bench_recompute,
    "fp8": bench_fp8,
}


# -- report ----------------------------------------------------------------------------------------
def _fmt(value: float | None) -> str:
    """A number with about four significant digits."""
    if value is None:
        return "-"
    for limit, digits in ((1000, 0), (100, 1), (10, 2), (1, 3)):
        if abs(value) >= limit:
            return f"{value:,.{digits}f}"
    return f"{value:.4f}"


def render_table(rows: Sequence[Row]) -> str:
    """The Markdown results table."""
    lines = ["| Measurement | Unit | Plain | Lite | Lite / plain | 95% CI | A/A control | Target | Verdict | Notes |",
             "|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for row in rows:
        if row.error is not None:
            lines.append(f"| {row.measurement} | {row.unit} | - | - | - | - | - | - | error | {row.error} |")
            continue
        ci = f"{row.ci[0]:.4f}-{row.ci[1]:.4f}" if row.ci else "-"
        control = f"{row.control:.4f}" if row.control is not None else "-"
        target = f"<= {row.target:.3f}" if row.target is not None else "-"
        ratio = f"**{row.ratio:.4f}**" if row.ratio is not None else "-"
        lines.append(f"| {row.measurement} | {row.unit} | {_fmt(row.plain)} | {_fmt(row.lite)} | {ratio} | {ci}"
                     f" | {control} | {target} | {row.verdict} | {row.note}; n={row.reps} |")
    return "\n".join(lines)


def environment_info(ctx: Context) -> dict[str, Any]:
    """Where and how the numbers were taken."""
    import torch

    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True,
                            text=True, timeout=30).stdout
    return {"date": _dt.datetime.now().isoformat(timespec="seconds"), "mode": ctx.config.name,
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "threads": ctx.threads, "load_average_start": ctx.load_at_start, "load_average_end": os.getloadavg(),
            "git_commit": commit.strip() or None,
            "platform": platform.platform()}


def render_report(rows: Sequence[Row], info: dict[str, Any], notes: Sequence[str], wall_s: float) -> str:
    """The whole Markdown report: header, table, notes."""
    start, end = (", ".join(f"{v:.2f}" for v in info[key]) for key in ("load_average_start", "load_average_end"))
    header = (f"# Lite vs plain PyTorch ({info['mode']} run, {info['date']})\n\n"
              f"torch {info['torch']}, Python {info['python']}, {info['cpus']} CPUs, torch threads {info['threads']},"
              f" load average {start} at start / {end} at end, commit {info['git_commit']},"
              f" benchmark wall time {wall_s:.0f} s.\n")
    extra = "\n".join(f"- {note}" for note in notes)
    legend = ("- Ratio = median(Lite) / median(plain) over interleaved repetitions; 95% CI = paired bootstrap."
              "\n- A/A control = a second plain arm / plain: how far from 1.0 noise alone moves a ratio."
              "\n- Verdict is `inconclusive` when the CI straddles the target.")
    return f"{header}\n{render_table(rows)}\n\n{legend}\n{extra}\n"


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short run (under 2 minutes) instead of the full one")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for single-process measurements (DDP ranks always use 1)")
    parser.add_argument("--results-dir", type=Path, default=HERE / "results", help="where latest.md/json go")
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def run_sections(ctx: Context, sections: Sequence[str]) -> list[Row]:
    """Run each selected benchmark; a failing one becomes an error row and the rest still run."""
    rows: list[Row] = []
    for section in sections:
        started = time.perf_counter()
        print(f"[bench] {section} ...", file=sys.stderr, flush=True)
        try:
            rows.extend(BENCHMARKS[section](ctx))
        except Exception as err:  # one broken benchmark must not lose the others' numbers
            message = str(err).replace("\n", " / ").replace("|", "/")[:400]
            rows.append(Row(section, section, "-", error=message))
        print(f"[bench] {section} done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = Context(config=QUICK if args.quick else FULL, threads=args.threads)
    sections = [s for s in SECTIONS if s in args.only.split(",")]
    started = time.perf_counter()
    try:
        rows = run_sections(ctx, sections)
    finally:
        shutil.rmtree(ctx.workdir, ignore_errors=True)
    wall_s = time.perf_counter() - started
    info = environment_info(ctx)
    report = render_report(rows, info, ctx.notes, wall_s)
    print(report)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "latest.md").write_text(report, encoding="utf-8")
    payload = {"info": info, "wall_s": wall_s, "notes": ctx.notes,
               "rows": [{**asdict(row), "verdict": row.verdict} for row in rows]}
    (args.results_dir / "latest.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return 1 if any(row.error is not None for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
