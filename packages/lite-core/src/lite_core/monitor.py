"""`ThroughputMonitor`: samples, items (tokens) and FLOPs per second, MFU, data-loading time and
peak memory of your own loop; `measure_flops`: the FLOPs of one training step, counted by torch.

MFU (model FLOPs utilisation) is the model's FLOPs per second (forward plus backward, as
`measure_flops` counts them, or as you give them) divided by the dense peak FLOP/s of every
device the job uses, in the dtype the matrix multiplications run in.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from lite_core.model._meta import meta_copy
from lite_core.model._module import is_set_up_model, state_of
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.precision.names import precision_entry, precision_names
from lite_core.launchers.rank import RESTART_VARIABLE

if TYPE_CHECKING:
    from lite_core.lite import LightningLite

T = TypeVar("T")

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")


def measure_flops(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  backward: bool = True, on_meta: bool = True) -> int:
    """The FLOPs of one step of `model` on `inputs`: forward, plus backward with `backward=True`.

    Counted by `torch.utils.flop_counter.FlopCounterMode` (matrix multiplications and
    convolutions; element-wise work is not counted). With `on_meta=True` the count runs on a
    copy of the model on the meta device, so it allocates no memory and costs no real step;
    `inputs` (tensors, alone or in dicts, lists, tuples) are moved to the meta device too.

    A Mixture-of-Experts layer counts its active FLOPs: each token through the experts its router
    chose, whether the experts loop or call `torch._grouped_mm` (a formula Lite adds to torch's
    counter). The routing depends on the data, so count an MoE on a real batch (`on_meta=False`)
    where its code needs the numbers of tokens per expert (`.tolist()`, `bincount`).

    It counts the whole model, before or after `setup()`, under every strategy: under pipeline
    parallelism, where a process holds only its stages' layers after `setup()`, it counts the whole
    model as it was before the cut (on the meta device, whatever `on_meta`), so every process gets
    one data-parallel replica's FLOPs on `inputs`, the batch one process is given.

    Args:
        model: the plain model, or the one `setup()` returned.
        inputs: what the model is called with: one tensor or a tuple of positional arguments.
        loss_fn: turns the model's output into the scalar to differentiate (default: `.sum()`).
        backward: count the backward pass too (about twice the forward).
        on_meta: count on a meta-device copy instead of the model itself.

    Returns:
        The FLOPs of one step on this batch.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from lite_core.model.parts import original_module

    module = original_module(model)
    whole = _whole_pipelined_model(model)
    if whole is not None:
        module, on_meta = whole, True
    if on_meta:
        module = meta_copy(module)
        inputs = tree_map_only(torch.Tensor, _meta_input, inputs)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    counter = FlopCounterMode(display=False, custom_mapping=_MISSING_FORMULAS)
    with counter:
        output = module(*args)
        if backward:
            loss = loss_fn(output) if loss_fn is not None else output.sum()
            loss.backward()
    return int(counter.get_total_flops())


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """`torch._grouped_mm`'s FLOPs, which torch's counter does not know: every row of the output
    is one token through its own group (expert) only, 2 FLOPs per multiply-add over the contracted
    size. Where both operands are 2-D, the groups split the contracted dimension (the experts'
    weight gradients: `[G, M, N]` out of `[M, K] x [K, N]`), so each output element of a group
    contracts over that group's part of K alone."""
    outputs = 1
    for size in out_shape:
        outputs *= size
    if len(a_shape) == 2 and len(b_shape) == 2:
        outputs //= out_shape[0]
    return 2 * outputs * a_shape[-1]


#: Formulas for the matrix products torch's counter does not count (it counts them as 0 FLOPs):
#: `_grouped_mm`, with which Mixture-of-Experts layers compute their experts, so that an MoE's
#: count is its active FLOPs (each token through its top-k experts, not through all of them).
_MISSING_FORMULAS = ({torch.ops.aten._grouped_mm: _grouped_mm_flops}
                     if hasattr(torch.ops.aten, "_grouped_mm") else {})


def _whole_pipelined_model(model: nn.Module) -> nn.Module | None:
    """The whole model on the meta device, as a pipeline kept it before cutting `model` into
    stages; `None` for a model no pipeline runs."""
    if not is_set_up_model(model):
        return None
    state = state_of(model)
    pipeline_of = getattr(state.strategy, "pipeline_of", None)  # strategies with a pipeline dimension
    pipeline = pipeline_of(state.forward_module) if pipeline_of is not None else None
    return None if pipeline is None else pipeline.whole_model


def _meta_input(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the meta device, a leaf that wants a gradient if the original does."""
    meta = tensor.detach().to("meta")
    return meta.requires_grad_() if tensor.requires_grad else meta


class ThroughputMonitor:
    """Throughput, MFU, data-loading time and peak memory of your loop, over a rolling window.

    Call `step()` once per batch with the number of samples (and items, e.g. tokens) this
    process's batch held. Every `log_every_n_steps` steps the monitor sends its metrics to Lite's
    loggers (`lite.log_dict`, rank 0: CSV, TensorBoard, W&B, MLflow) and, if given one, to a
    progress bar. Each row also holds what the checkpoints cost the loop since the row before:
    `checkpoint/stall_seconds`, the time spent inside `lite.save` (the whole write when blocking;
    the copy to host memory, and any wait for the save before, with `blocking=False`), and
    `checkpoint/saves`; and what is known of failures: under `lite run`, `fault/restarts` (the
    restarts of the job before this attempt), and whatever the strategy reports
    (`Strategy.fault_tolerance_figures`: under `ddp_ft`/`fsdp_ft` the replica groups in the last
    quorum, `fault/replica_groups`, and this group's heals from a peer, `fault/heals`).

    Under gradient accumulation, call `step()` after every micro-batch and pass the optimizer
    steps taken so far, the step you log your own metrics at (`step=optimizer_step`). The rates
    still count every micro-batch (so `flops_per_step` is the FLOPs of one micro-batch, as
    `measure_flops(model, x)` counts them), but the monitor logs at your optimizer steps, once at
    every `log_every_n_steps`-th, so its rows line up with yours. Without `step=` each call counts
    as one step and the rows are numbered by calls, which run ahead of your optimizer steps.

    Global rates assume every data-parallel replica processes a batch of the same size:
    `samples_per_sec = batch_size * data_parallel_size / time`. Per-device rates divide by the
    data-parallel size (the ranks that hold distinct data, as the strategy's sampler shards
    them), FLOP/s per device and MFU by every device the job uses.

    Args:
        lite: the `LightningLite` the loop runs in.
        window: how many recent steps the rates average over.
        flops_per_step: the FLOPs of one step of one data-parallel replica: the whole model on the
            batch this process gets, as `measure_flops` counts it (before or after `setup()`, under
            pipeline and tensor parallelism too); `None` leaves FLOP/s and MFU out. The job's FLOPs
            are it times the data-parallel size, counted once, and MFU divides them by every device.
        peak_flops: dense peak FLOP/s of one device, overriding what the accelerator knows.
        dtype: the matmul dtype for the accelerator's peak (`"fp32"`, `"tf32"`, `"bf16"`, `"fp16"`,
            `"fp8"`, `"fp64"`); default: from the precision (`32-true` is `tf32` when torch allows it).
        log_every_n_steps: how often `step()` logs (0: never; read `compute()` yourself).
        progress_bar: a tqdm bar (e.g. from `lite_core.progress_bar`) whose postfix shows the
            samples per second and MFU.

    Example:
        monitor = ThroughputMonitor(self, flops_per_step=measure_flops(model, x), log_every_n_steps=10)
        for x, y in monitor.timed(loader):
            ...
            optimizer.step()
            monitor.step(batch_size=len(x), items=x.numel())

        # with gradient accumulation over `accumulate` micro-batches:
        for i, (x, y) in enumerate(monitor.timed(loader)):
            ...
            if (i + 1) % accumulate == 0:
                optimizer.step()
            monitor.step(batch_size=len(x), step=(i + 1) // accumulate)
    """

    def __init__(self, lite: LightningLite, window: int = 50, flops_per_step: float | None = None,
                 peak_flops: float | None = None, dtype: str | None = None, log_every_n_steps: int = 50,
                 progress_bar: Any = None) -> None:
        _check_positive_or_none(peak_flops, "peak_flops", "the dense peak FLOP/s of one device, e.g. 989e12")
        _check_positive_or_none(flops_per_step, "flops_per_step", "the FLOPs of one step, e.g. from measure_flops()")
        if window < 2:
            raise ConfigurationError(f"window={window} needs at least 2 steps to measure a rate: pass window >= 2.")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigurationError(f"dtype={dtype!r} is not a matmul dtype Lite knows: pass one of {list(DTYPES)}.")
        self._lite = lite
        self._flops_per_step = flops_per_step
        self._log_every = log_every_n_steps
        self._bar = progress_bar
        shard = lite.strategy.distributed_sampler_kwargs()
        self.data_parallel_size = int(shard["num_replicas"]) if shard else 1
        self.devices = max(lite.world_size, 1)
        self.peak_flops = peak_flops if peak_flops is not None else self._accelerator_peak(dtype)
        # (end time, samples, items, seconds waiting for data) of each step; one more than the window.
        self._steps: deque[tuple[float, int, int, float]] = deque(maxlen=window + 1)
        self._waited = 0.0
        self.step_count = 0
        self._next_log = log_every_n_steps if log_every_n_steps > 0 else -1
        self._logged_step: int | None = None  # the last optimizer step logged, with step= given
        self._checkpoints_at_last_row = (0.0, 0)  # (stalled seconds, saves) when the last row was logged

    def _accelerator_peak(self, dtype: str | None) -> float | None:
        plan = self._lite._plan  # the job's accelerator and precision, not the strategy's
        return plan.accelerator.peak_flops(plan.strategy.root_device, dtype or _matmul_dtype(plan.precision.name))

    def timed(self, dataloader: Iterable[T]) -> Iterator[T]:
        """Iterate `dataloader`, counting the time each batch took to arrive as data-loading time."""
        iterator = iter(dataloader)
        while True:
            started = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._waited += time.perf_counter() - started
            yield batch

    def step(self, batch_size: int, items: int | None = None, step: int | None = None) -> dict[str, float] | None:
        """Record one finished batch of this process: `batch_size` samples holding `items` items
        (tokens; default: the samples). Also marks a step of the profiler `lite.profile()` runs.

        Args:
            batch_size: the samples of this process's batch.
            items: the items (tokens, pixels, ...) they hold; default: the samples.
            step: the optimizer steps taken so far, under gradient accumulation (call `step()`
                after every micro-batch; the step you log your own metrics at). The monitor then
                logs at your steps, once at every `log_every_n_steps`-th, so its rows line up with
                yours; without it, every call counts as one step and logs at the number of calls.

        Returns:
            The metrics when this call logged them, else `None`.
        """
        # The hot path of every step: plain attribute reads, one clock reading, one append.
        if type(batch_size) is not int or batch_size <= 0:
            _refuse_batch_size(batch_size)
        self._steps.append((_clock(), batch_size, items, self._waited))  # items None: the samples
        self._waited = 0.0
        self.step_count += 1
        self._lite._profiles.step()
        if step is not None:
            return self._log_at_optimizer_step(step)
        if self.step_count == self._next_log:
            self._next_log += self._log_every
            return self._log(self.step_count)
        return None

    def _log_at_optimizer_step(self, step: int) -> dict[str, float] | None:
        """Log once at each of the user's steps that is a multiple of `log_every_n_steps`."""
        if type(step) is not int or step < 0:
            _refuse_step(step)
        if self._log_every <= 0 or step == 0 or step % self._log_every or step == self._logged_step:
            return None
        self._logged_step = step
        return self._log(step)

    def _log(self, step: int) -> dict[str, float]:
        metrics = self.compute()
        if metrics:
            metrics.update(self._checkpoint_stall())
            metrics.update(self._faults())
            self._lite.log_dict(metrics, step=step)
            self._show(metrics)
        return metrics

    def compute(self) -> dict[str, float]:
        """The metrics over the window (empty until two steps were recorded)."""
        if len(self._steps) < 2:
            return {}
        steps = list(self._steps)[1:]  # the first entry only marks when the window's first step began
        elapsed = steps[-1][0] - self._steps[0][0]
        samples = sum(s[1] for s in steps) * self.data_parallel_size
        items = sum(s[1] if s[2] is None else s[2] for s in steps) * self.data_parallel_size
        batches = len(steps) * self.data_parallel_size
        metrics = {
            "throughput/batches_per_sec": batches / elapsed,
            "throughput/samples_per_sec": samples / elapsed,
            "throughput/items_per_sec": items / elapsed,
            "throughput/device/batches_per_sec": batches / elapsed / self.data_parallel_size,
            "throughput/device/samples_per_sec": samples / elapsed / self.data_parallel_size,
            "throughput/device/items_per_sec": items / elapsed / self.data_parallel_size,
            "throughput/data_wait_fraction": min(sum(s[3] for s in steps) / elapsed, 1.0),
            "memory/peak_bytes": float(self._peak_memory()),
        }
        if self._flops_per_step is not None:
            flops = self._flops_per_step * len(steps) * self.data_parallel_size / elapsed
            metrics["throughput/flops_per_sec"] = flops
            metrics["throughput/device/flops_per_sec"] = flops / self.devices
            if self.peak_flops is not None:
                metrics["throughput/mfu"] = flops / (self.devices * self.peak_flops)
        return metrics

    def _checkpoint_stall(self) -> dict[str, float]:
        """The seconds the loop spent in `save` and the saves since the last row this monitor logged."""
        before_seconds, before_saves = self._checkpoints_at_last_row
        self._checkpoints_at_last_row = now_seconds, now_saves = self._lite.checkpoint_stall
        return {"checkpoint/stall_seconds": now_seconds - before_seconds, "checkpoint/saves": float(now_saves - before_saves)}

    def _faults(self) -> dict[str, float]:
        """The job's restarts so far under `lite run` (`fault/restarts`, this attempt's number) and
        what the strategy knows of failures (a fault-tolerant strategy's replica groups and heals)."""
        figures = dict(self._lite.strategy.fault_tolerance_figures())
        restarts = os.environ.get(RESTART_VARIABLE)
        if restarts is not None:
            figures["fault/restarts"] = float(restarts)
        return figures

    def _peak_memory(self) -> int:
        plan = self._lite._plan
        return plan.accelerator.peak_memory(plan.strategy.root_device)

    def _show(self, metrics: dict[str, float]) -> None:
        if self._bar is None:
            return
        postfix = {"samples/s": f"{metrics['throughput/samples_per_sec']:.3g}"}
        if "throughput/mfu" in metrics:
            postfix["MFU"] = f"{metrics['throughput/mfu']:.1%}"
        self._bar.set_postfix(postfix, refresh=False)


_clock = time.perf_counter


def _refuse_batch_size(batch_size: Any) -> None:
    if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0:
        return  # an int subclass
    raise MisuseError(f"ThroughputMonitor.step() got batch_size={batch_size!r}: pass the number of"
                      " samples in this step's batch, a positive int.")


def _refuse_step(step: Any) -> None:
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return  # an int subclass
    raise MisuseError(f"ThroughputMonitor.step() got step={step!r}: pass your optimizer step, an int >= 0, or"
                      " leave it out to count every call as one step.")


def _matmul_dtype(precision: str) -> str:
    """The dtype the matrix products of `precision` run in (its row's; `32-true` and the quantized
    ones are `tf32` when torch's float32 matmul precision allows TF32:
    `torch.set_float32_matmul_precision("high")` or `"medium"`)."""
    matmul = precision_entry(precision).matmul if precision in precision_names() else None
    if matmul is not None:
        return matmul
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _check_positive_or_none(value: Any, name: str, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"{name}={value!r} is not a positive number: pass {what}, or None.")
