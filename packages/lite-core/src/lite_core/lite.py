"""`LightningLite`: keep your training loop, choose the hardware and strategy in the constructor."""

from __future__ import annotations

import functools
import os
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lite_core.checkpoint import TrainableState
from lite_core.connector import _defaults
from lite_core.connector._arguments import as_list, checked_loggers, legacy_devices
from lite_core.connector._connect import connect
from lite_core.connector._plan import Plan
from lite_core.data._evaluation import EvaluationPasses
from lite_core.data._loaders import Loaders
from lite_core.running._callbacks import Callbacks, Loggers
from lite_core.running._checkpoints import Checkpoints
from lite_core.running._collectives import Collectives
from lite_core.running._execution import Running, wrap_run
from lite_core.profiler import Profiles
from lite_core.seed import seed_everything
from lite_core.training._models import Claims, Models

if TYPE_CHECKING:  # for the annotations only (read as text: `from __future__ import annotations`)
    from lite_core.accelerators.accelerator import Accelerator
    from lite_core.checkpoint import CheckpointIO
    from lite_core.environments.environment import ClusterEnvironment
    from lite_core.loggers.logger import Logger
    from lite_core.model._module import LiteModule
    from lite_core.precision.precision import Precision
    from lite_core.strategies.strategy import Strategy

T = TypeVar("T")


class LightningLite:
    """Runs your own PyTorch loop on any accelerator and strategy chosen by the arguments.

    Put the loop in `run()` (or pass a function to `launch()`); Lite starts the processes, sets
    up each one once, and hands rank 0's return value back to the caller.

    `accelerator`, `strategy`, `devices`, `num_nodes` and `precision` that the code does not pass
    are read from `LITE_ACCELERATOR`, `LITE_STRATEGY`, `LITE_DEVICES`, `LITE_NUM_NODES` and
    `LITE_PRECISION` (which `lite run` sets) before falling back to the defaults; an argument
    passed in code wins, with a warning naming the variable it overrode.

    Args:
        accelerator: `"cpu"`, `"cuda"`/`"gpu"`, `"tpu"`/`"xla"`, `"auto"` or an `Accelerator`.
        strategy: `"auto"`, `"single_device"`, `"ddp"`, `"ddp_spawn"`, `"ddp_fork"`,
            `"ddp_notebook"`, `"fsdp"`, `"ddp_sharded"`, `"ddp_sharded_spawn"`, a backend's name
            (e.g. `"deepspeed_stage_3"`) or a `Strategy`.
        devices: how many devices (processes) per node, a list of indexes, or `"auto"`.
        num_nodes: how many machines the job spans.
        precision: `"64-true"`, `"32-true"`, `"16-mixed"`, `"bf16-mixed"`, `"16-true"`,
            `"bf16-true"` (the legacy `64`, `32`, `16`, `"bf16"` still work, with a `FutureWarning`) or a `Precision`.
        plugins: a `Precision`, `ClusterEnvironment` or `CheckpointIO` instance, or a list.
        loggers: a `Logger` (e.g. `CSVLogger`, `TensorBoardLogger`) or a list of them: objects with
            `log_metrics(metrics, step)` and optionally `finalize()`; only rank 0 logs.
        callbacks: objects whose methods `call(hook_name, ...)` invokes, on every rank.
        gpus: deprecated, means `accelerator="cuda", devices=gpus`.
        tpu_cores: deprecated, means `accelerator="tpu", devices=tpu_cores`.
    """

    @_defaults.from_environment
    def __init__(self, accelerator: str | Accelerator = "auto", strategy: str | Strategy = "auto",
                 devices: int | str | list[int] = "auto", num_nodes: int = 1,
                 precision: str | int | Precision = "32-true",
                 plugins: Precision | ClusterEnvironment | CheckpointIO
                 | list[Precision | ClusterEnvironment | CheckpointIO] | None = None,
                 loggers: Logger | list[Logger] | None = None, callbacks: object | list[object] | None = None, *,
                 gpus: int | str | list[int] | None = None, tpu_cores: int | list[int] | None = None) -> None:
        accelerator, devices = legacy_devices(accelerator, devices, gpus=gpus, tpu_cores=tpu_cores)
        # A count left out (`devices`, `num_nodes`) arrives as a `_defaults.LeftToLauncher` value.
        # The job's plan: every choice resolved and checked once; each room takes its parts of it.
        self._plan: Plan = connect(accelerator, strategy, devices, num_nodes, precision, plugins)
        self._loggers = Loggers(checked_loggers(as_list(loggers)), self._plan.strategy)
        self._callbacks = Callbacks(as_list(callbacks))
        self._checkpoints = Checkpoints(self._plan.strategy, self._plan.checkpoint_io, self._plan.precision)
        self._collectives = Collectives(self._plan.strategy)
        self._running = Running(self._plan.strategy, self._plan.launcher, self._checkpoints, self._loggers)
        self._start_set_up()

    def _start_set_up(self) -> None:
        """No model, optimizer or loader set up yet (also in a spawned process's copy)."""
        claims, models = Claims(), []
        evaluations = EvaluationPasses(models)
        self._models = Models(self._plan.strategy, self._plan.precision, claims, models, evaluations)
        self._profiles = Profiles()  # what `profile()` runs, whose steps a ThroughputMonitor marks
        self._loaders = Loaders(self._plan.strategy, claims, evaluations)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__:
            cls.run = wrap_run(cls.__dict__["run"])  # type: ignore[method-assign]

    def __getstate__(self) -> dict[str, Any]:
        # A spawned process gets a copy without the parent's set-up objects.
        state = self.__dict__.copy()
        state.update(_models=None, _loaders=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_set_up()

    # -- properties ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._plan.strategy.root_device

    @property
    def global_rank(self) -> int:
        """Rank of this process across all nodes."""
        return self._plan.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self._plan.strategy.local_rank

    @property
    def node_rank(self) -> int:
        """Rank of this process's node."""
        return self._plan.strategy.node_rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self._plan.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        """Whether this is the process with global rank 0."""
        return self.global_rank == 0

    @property
    def strategy(self) -> Strategy:
        """The connected strategy: how the model, optimizers and collectives are spread over processes."""
        return self._plan.strategy

    # -- entry points ------------------------------------------------------------------------------
    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Override this with your training loop; Lite launches and wraps it."""
        raise NotImplementedError(
            f"{type(self).__name__} does not override run(): put your loop in run(), or call"
            " launch(fn) with a function instead."
        )

    def launch(self, fn: Callable[..., T] | None = None, *args: Any, **kwargs: Any) -> T | None:
        """Start the processes and run `fn(self, *args, **kwargs)` in each; returns rank 0's result.

        Without `fn`, only launchers that re-run the script (e.g. `ddp`) work: the processes are
        started and set up, and the code after `launch()` runs in every one of them.
        """
        if fn is not None:
            return cast(T, self._running.launch(functools.partial(self._execute, fn, self), args, kwargs))
        self._running.launch_without_function()
        return None

    def _user_run(self, *args: Any, **kwargs: Any) -> Any:
        # Looked up by name (not captured) so a pickled copy in a spawned process finds it too.
        return type(self).run.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]

    def _execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return self._running.execute(fn, *args, **kwargs)

    # -- setup -----------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: Optimizer, move_to_device: bool = True,
              loss_fn: Callable[..., torch.Tensor] | None = None, forward_methods: str | Sequence[str] = ()) -> Any:
        """Set up a model and its optimizers; returns the model, or `(model, *optimizers)`.

        With `loss_fn`, `model(x, target=y)` returns `loss_fn(model(x), y)`: the loop
        `loss = model(x, target=y)`, `backward(loss)`, `optimizer.step()` then runs unchanged under
        every strategy, pipeline parallelism included (where the schedule needs the loss function
        and runs the backward pass inside that call). `loss_fn(output, target)` averages over its
        batch.

        A model compiled with `torch.compile(model, **options)` is set up as its plain module and
        the strategy's wrapper around it is compiled with the same options; the returned model's
        state dict keys are the plain module's.

        `model.generate(...)` and the methods named in `forward_methods` (say `["training_step"]`,
        a method that computes on the model's weights without calling `self(x)`) run under the
        precision and through the strategy, as `model(x)` does: every rank must call them. Every
        other method (`save_pretrained(folder, state_dict=...)`, `num_parameters()`) runs on the
        model as it is, whatever its arguments, so one rank alone may call it; its own calls of
        `self(x)` run through the strategy.
        """
        return self._models.setup(model, optimizers, move_to_device, loss_fn, _names(forward_methods))

    def setup_module(self, model: nn.Module, move_to_device: bool = True,
                     loss_fn: Callable[..., torch.Tensor] | None = None,
                     forward_methods: str | Sequence[str] = ()) -> LiteModule:
        """Move the model to the device, apply the precision and wrap it for the strategy (a
        `torch.compile`d model as `setup` does: wrapped plain, then compiled again); `loss_fn`
        and `forward_methods` as for `setup`."""
        return self._models.setup_module(model, move_to_device, loss_fn, _names(forward_methods))

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Wrap optimizers so that `step()` goes through the strategy and precision."""
        return self._models.setup_optimizers(optimizers)

    def setup_dataloaders(self, *dataloaders: DataLoader, replace_sampler: bool = True,
                          move_to_device: bool = True, sharding: str = "auto", split_batches: bool = False) -> Any:
        """Shard each dataloader across processes and move its batches to the device.

        Under a distributed strategy each rank loads its own shard (ranks that hold the same data,
        e.g. tensor-parallel peers, share one). A training pass and an evaluation pass shard
        differently:

        - training: every rank gets as many samples, so DDP's and FSDP's collectives line up;
          where the dataset does not split evenly, samples from its start are repeated;
        - evaluation: every sample once, none repeated; every rank still iterates as many
          batches, the last one smaller or, where fewer samples than ranks remain, empty (0 rows),
          so a collective called once per batch is called as often on every rank. Summing over
          the ranks (`all_reduce`, `all_gather`, `gather_for_metrics`, torchmetrics) gives what
          one process computes.

        Args:
            dataloaders: torch `DataLoader`s.
            replace_sampler: shard each loader (`False`: its sampler already yields this rank's
                samples, e.g. your own `DistributedSampler`).
            move_to_device: move each batch to this process's device.
            sharding: `"auto"` decides when each pass starts: a pass that starts with gradients
                disabled (`torch.no_grad()`, `torch.inference_mode()`) or with every set-up model
                in eval mode (`model.eval()`) is an evaluation pass; `"evaluation"` or
                `"training"` shards every pass that way.
            split_batches: the loader's `batch_size` is the global batch: each training batch is
                the batch one plain process draws from this loader, cut into one contiguous part
                per data-parallel process, so the job takes the same steps on any number of
                processes. The batch size must be a multiple of the data-parallel size; the
                epoch's short last batch (without `drop_last`) is cut into parts that differ by at
                most one sample. Processes that hold the same data (tensor-parallel peers) get
                the same part. Evaluation passes shard as without it (each rank takes whole
                batches of `batch_size`). Needs `replace_sampler=True`.

        A stream (`IterableDataset`) is read whole on every process and cut into rounds of one
        global batch, rank `r` taking the `r`-th contiguous part of each round (with
        `num_workers=K`, each worker every `K`-th round); a dataset with `lite_shard(num_replicas,
        rank)` shards itself instead. See "Streams" on the "Preemption and resuming" page.

        The set-up loader's `state_dict()` is its place in the job's global sample order (epoch,
        the epoch's order, samples consumed): `load` resumes it at the next sample under any
        strategy and number of processes (see the "Preemption and resuming" page).
        """
        return self._loaders.setup(dataloaders, replace_sampler, move_to_device, sharding, split_batches)

    # -- training step ---------------------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, *args: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        """`tensor.backward()` through the strategy and precision (use it instead of `loss.backward()`)."""
        self._models.backward(tensor, model, args, kwargs)

    def clip_gradients(self, model: nn.Module, optimizer: Optimizer, clip_val: float | None = None,
                       max_norm: float | None = None, norm_type: float = 2.0,
                       error_if_nonfinite: bool = True) -> torch.Tensor | None:
        """Clip gradients by value (`clip_val`) or total norm (`max_norm`, returns the norm)."""
        return self._models.clip_gradients(model, optimizer, clip_val, max_norm, norm_type, error_if_nonfinite)

    def no_backward_sync(self, model: nn.Module, enabled: bool = True) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation in backward passes inside this context (accumulation)."""
        return self._models.no_backward_sync(model, enabled)

    def autocast(self) -> AbstractContextManager[Any]:
        """The precision's forward context, for code that runs outside the wrapped model."""
        return self._plan.precision.forward_context()

    def init_module(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        """Context for building modules directly on the device and in the precision.

        Args:
            empty_init: `True` under a sharding strategy (`fsdp`) builds the parameters on the
                meta device and initialises them after sharding; under strategies that keep whole
                models it skips parameter initialisation (for weights loaded right after). Either
                way, buffers written in `__init__` (masks, constants) keep their values.
        """
        return self._plan.strategy.module_init_context(empty_init, precision=self._plan.precision)

    def to_device(self, obj: Any) -> Any:
        """Move a module, or every tensor in a nested structure, to this process's device.

        Tensors and objects with a `.to(device)` method (e.g. a tokenizer's output) move wherever
        they sit in dicts, lists, tuples, namedtuples and dataclasses (frozen ones too).
        """
        if isinstance(obj, nn.Module):
            return self._plan.strategy.module_to_device(obj)
        return self._plan.strategy.batch_to_device(obj)

    # -- processes ---------------------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process arrives."""
        self._collectives.barrier(name)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Rank `src`'s `obj` on every process.

        Args:
            obj: any picklable object. Tensors in it (alone or in dicts, lists, tuples) arrive on
                this process's device; everything else, Python numbers included, arrives as it
                was sent.
            src: the global rank whose `obj` every process receives.
        """
        return self._collectives.broadcast(obj, src)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Each tensor in `data` stacked from every process along a new first dimension.

        Args:
            data: a tensor, a Python number, or dicts, lists and tuples of them. Numbers become
                tensors; every tensor must have the same shape on every process.
            group: the process group to gather from (all processes by default).
            sync_grads: let gradients flow back through the gather.

        Returns:
            `data`'s structure with each leaf a tensor on `self.device` of shape
            `(world_size, *shape)`.
        """
        return self._collectives.all_gather(data, group, sync_grads)

    def all_reduce(self, data: Any, group: Any = None, reduce_op: str = "mean") -> Any:
        """Each tensor in `data` reduced over every process.

        Args:
            data: a tensor, a Python number (a bool counts as 0 or 1), or dicts, lists and tuples
                of them; e.g. `self.all_reduce(test_loss, reduce_op="sum")` with a float.
            group: the process group to reduce over (all processes by default).
            reduce_op: `"mean"`, `"sum"`, `"max"`, `"min"` or `"product"`.

        Returns:
            `data`'s structure with each leaf a tensor on `self.device`; the input is not modified.
        """
        return self._collectives.all_reduce(data, group, reduce_op)

    def gather_for_metrics(self, data: Any) -> Any:
        """Each tensor in `data` concatenated over the processes along its first dimension.

        For evaluation: call it on each batch's predictions and targets (or once on everything a
        process collected) and compute the metric from the result. Processes may hold different
        numbers of rows (the last batch of an evaluation pass is smaller or empty on some ranks);
        each row appears once, nothing is left out or repeated, and processes that hold the same
        data (tensor-parallel peers) count once. Over the batches of an evaluation pass the rows
        come in the one-process order. With one process it returns `data` as tensors.

        Args:
            data: a tensor, a Python number, or dicts, lists and tuples of them. A 0-dim tensor or
                a number counts as one row. Beyond the first, every dimension must be the same on
                every process.

        Returns:
            `data`'s structure with each leaf a tensor on `self.device` holding every process's rows.
        """
        return self._collectives.gather_for_metrics(data)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Rank 0 (of the node, with `local=True`) runs the block first, the others after it."""
        first = (self.local_rank if local else self.global_rank) == 0
        if not first:
            self.barrier("rank_zero_first")
        yield
        if first:
            self.barrier("rank_zero_first")

    # -- checkpoints, logging, callbacks -----------------------------------------------------------------
    def full_state_dict(self, model: nn.Module, trainable_only: bool = False) -> dict[str, Any]:
        """The set-up model's whole state dict as plain CPU tensors on rank 0, under every strategy
        (sharded ones gather it; the other ranks get an empty dict): what `torch.save` on rank 0
        writes for a plain model to load. The tensors are a copy, never the model's own memory, so
        a snapshot kept in memory (`best = lite.full_state_dict(model)`) does not follow training.
        Call it on every rank.

        With `trainable_only=True`, only the parameters that train (`requires_grad`: LoRA
        adapters, not their frozen base), and under `fsdp` only those are gathered. peft's
        `model.save_pretrained(folder, state_dict=...)` on rank 0 writes them as an adapter that
        `PeftModel.from_pretrained` reads (docs/fine-tuning.md).
        """
        if trainable_only:
            return self._plan.strategy.full_trainable_state_dict(model)
        return self._plan.strategy.full_module_state_dict(model)

    def trainable_state(self, model: nn.Module) -> TrainableState:
        """The set-up model's trainable parameters as one entry of `save` and `load`'s content: an
        adapters-only checkpoint, which the optimizer's state (it holds only those parameters) joins.

            self.save({"adapters": self.trainable_state(model), "optimizer": optimizer}, path)
            self.load(path, {"adapters": self.trainable_state(model), "optimizer": optimizer})

        Saved as whole tensors under the model's own names (what `full_state_dict(model,
        trainable_only=True)` returns) under every strategy, and loaded under any strategy and
        process count into a model built the same way (the base loaded from its own files); the
        frozen weights are neither written nor touched. A saved weight that does not train in
        the model, or a trainable one missing, raises a `CheckpointError`.
        """
        return TrainableState(self._plan.strategy, model)

    def export_safetensors(self, model: nn.Module, folder: str | os.PathLike[str],
                           max_file_bytes: int = 5 * 10**9) -> None:
        """Write the set-up model's weights as Hugging Face safetensors, which `transformers`'
        `from_pretrained` loads once the model's `config.json` is beside them.

        Under every strategy (sharded ones gather the weights to rank 0, which writes them),
        through torch distributed checkpoint's `HuggingFaceStorageWriter`. A weight tied to an
        earlier one (a language model's head) is left out, as `transformers` leaves it out. Call it
        on every rank; a failure raises a `CheckpointError` on every rank.

        Args:
            model: the set-up model, or a module inside it: peft's `model.merge_and_unload()`
                (called on every rank) returns the base model with the adapters merged into its
                weights, which this writes under the base's own names.
            folder: where the files go, a local folder or an fsspec URL (the files are written
                locally and put into the store, the index last):
                `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`.
            max_file_bytes: the largest file; a tensor larger than that gets a file of its own.
        """
        self._checkpoints.export_safetensors(model, folder, max_file_bytes, self._models.holder_of(model))

    def load_safetensors(self, model: nn.Module, folder: str | os.PathLike[str]) -> None:
        """Load Hugging Face safetensors (what `transformers`' `save_pretrained` or
        `export_safetensors` wrote) into the set-up model, each process reading only the slices
        its own shards hold: a model built inside `init_module(empty_init=True)` under fsdp or
        model parallel is never whole on any process.

        Through torch distributed checkpoint's `HuggingFaceStorageReader`. A weight tied to an
        earlier one is the same tensor and is not read. Call it on every rank.

        Args:
            model: the set-up model (under `deepspeed` and XLA strategies, refused: load with
                `from_pretrained` before `setup` there).
            folder: a local folder with `model.safetensors.index.json` and its files, or one
                `model.safetensors`, on every node (a URL is refused: download it first).

        Raises:
            CheckpointError: the files lack a weight of the model (naming how many and the first).
        """
        self._checkpoints.load_safetensors(model, folder)

    def save(self, content: dict[str, Any], filepath: str | os.PathLike[str], blocking: bool = True) -> None:
        """Save `content` (modules and optimizers become their state) atomically from rank 0.

        Args:
            content: what to save, by key; modules, optimizers and objects with `state_dict()`
                are saved as their state.
            filepath: the file (or, under `fsdp`, the directory) to write: a local path or an fsspec
                URL such as `"s3://bucket/run/step-100"` (a str; see docs/cloud-checkpoints.md),
                refused before anything is written where its back end is not installed.
            blocking: `False` returns once the state is copied to host memory and writes it in a
                background thread while training goes on. The next `save`, `load`,
                `wait_for_checkpoint()` and the end of `run()` wait for it, and raise a
                `CheckpointError` on every rank if the write failed. A strategy that cannot write
                in the background saves in the foreground with a warning that says why.
        """
        self._checkpoints.save(content, filepath, blocking)

    @property
    def checkpoint_stall(self) -> tuple[float, int]:
        """`(seconds, saves)`: how long this process's loop has spent inside `save` so far (the
        whole write when blocking; with `blocking=False` the copy to host memory and any wait for
        the save before it), and how many saves it made. `ThroughputMonitor` logs both per row."""
        return self._checkpoints.stalled_seconds, self._checkpoints.saves

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint that `save(..., blocking=False)` is writing is complete.

        Raises a `CheckpointError` on every rank if its write failed on any rank. Every rank must
        call it; it returns at once when no save is in flight.
        """
        self._checkpoints.wait()

    def load(self, filepath: str | os.PathLike[str], state: dict[str, Any] | None = None, strict: bool = True,
             weights_only: bool = True, missing_ok: bool = False) -> dict[str, Any]:
        """Read a checkpoint; restore `state`'s modules, optimizers and values in place; return the content.

        `filepath` may be a file or a sharded checkpoint directory (written under `fsdp`), saved
        under any strategy and process count.

        Args:
            filepath: the checkpoint file or sharded checkpoint directory, a local path or an
                fsspec URL; a URL whose upload never finished is refused (`lite_core.checkpoint.latest`
                finds the last complete one under a prefix).
            state: objects to restore in place (modules, optimizers, plain values), by key.
            strict: whether every key of `state` must be in the checkpoint, and each module's
                weights must have exactly the keys the checkpoint holds for it (otherwise a
                `CheckpointError` names the model's class, how many keys differ and the first few).
            weights_only: load with `torch.load(..., weights_only=True)` (safe for untrusted files).
            missing_ok: when nothing exists at `filepath`, return `{}` and leave `state` untouched
                instead of raising. With it, `self.load(path, state, missing_ok=True)` at the top
                of `run()` resumes a restarted job and starts a fresh one alike.

        If a sharded save was interrupted while it replaced the checkpoint at `filepath` (between
        moving the old one aside and moving the new one in), `load` reads the previous
        checkpoint from where that save had moved it, with a warning.
        """
        return self._checkpoints.load(filepath, state, strict, weights_only, missing_ok)

    @contextmanager
    def profile(self, folder: str | os.PathLike[str], ranks: list[int] | None = None, wait: int = 1,
                warmup: int = 1, active: int = 3, repeat: int = 1, **profiler_kwargs: Any) -> Generator[Any, None, None]:
        """Run torch's profiler (`torch.profiler.profile`) on `ranks` and write one Chrome trace
        per rank into `folder`: `trace-rank{R}.json` (`trace-rank{R}-{n}.json` with `repeat > 1`).

        Mark each step with the `step()` of the object this yields, or let a `ThroughputMonitor`
        do it (its `step()` marks the profiler's step too; use one or the other). The schedule
        skips `wait` steps, warms up for `warmup` and records `active` steps, `repeat` times.

        Args:
            folder: where the traces go (created if needed).
            ranks: the global ranks to profile; `None` profiles every rank.
            wait: steps to skip before profiling.
            warmup: steps profiled but thrown away (the profiler's own start-up cost).
            active: steps recorded in the trace.
            repeat: how many wait/warm-up/active cycles (each writes a trace).
            **profiler_kwargs: passed on to `torch.profiler.profile` (`activities`,
                `record_shapes`, `profile_memory`, `with_stack`, ...).

        Example:
            with self.profile("traces", wait=1, warmup=1, active=2) as prof:
                for batch in loader:
                    ...
                    prof.step()
        """
        from lite_core.profiler import profile

        with profile(self._profiles, self.global_rank, folder, ranks, wait, warmup, active, repeat,
                     **profiler_kwargs) as prof:
            yield prof

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one value to every logger (rank 0 only)."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log several values to every logger (rank 0 only)."""
        self._loggers.log_dict(metrics, step)

    def log_hyperparams(self, config: Any) -> None:
        """Record the run's configuration (a dict, a dataclass or an argparse Namespace) with every
        logger that has `log_hyperparams` (`WandbLogger`, `MLflowLogger`), from rank 0 only."""
        self._loggers.log_hyperparams(config)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call `hook_name(*args, **kwargs)` on every callback that defines it."""
        self._callbacks.call(hook_name, args, kwargs)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool = True) -> int:
        """Seed `random`, NumPy and torch (and dataloader workers with `workers=True`)."""
        return seed_everything(seed, workers=workers)


def _names(forward_methods: str | Sequence[str]) -> tuple[str, ...]:
    """`setup(forward_methods=...)` as a tuple: one name alone, or several."""
    return (forward_methods,) if isinstance(forward_methods, str) else tuple(forward_methods)
