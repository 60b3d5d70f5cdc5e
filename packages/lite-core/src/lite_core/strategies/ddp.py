"""Distributed data parallel: one model replica per process, gradients averaged in backward."""

from __future__ import annotations

import atexit
import os
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, ClassVar, ContextManager, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map_only

from lite_core.environ import restore_environ
from lite_core.errors import ConfigurationError, MisuseError
from lite_core.launchers.launcher import Launcher
from lite_core.precision.precision import Precision
from lite_core.strategies._progress import CollectiveProgress
from lite_core.strategies._recompute import recompute
from lite_core.strategies._settle import settle_collectives
from lite_core.strategies.process_group import init_attempt_process_group
from lite_core.strategies.strategy import Strategy, check_reduce_op

T = TypeVar("T")

_DEFAULT_TIMEOUT_SECONDS = 1800.0
_TIMEOUT_VARIABLE = "LITE_COLLECTIVE_TIMEOUT"
#: The most dimensions a tensor passed to `all_gather` may have (its shape is exchanged first).
_MAX_GATHER_DIMS = 64
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


class DDPStrategy(Strategy):
    """`strategy="ddp"`: re-runs the user's script for the other local ranks.

    Args:
        timeout: how long a collective may wait for the other ranks before the job fails
            (seconds or a `timedelta`); defaults to `$LITE_COLLECTIVE_TIMEOUT` or 30 minutes.
        process_group_backend: overrides the accelerator's `torch.distributed` backend.
        activation_checkpointing: module classes (your model's blocks) whose activations are
            recomputed in the backward pass instead of kept: less memory, one more forward pass of
            each block. Applied with torch's composable `checkpoint`, so module names and
            checkpoint keys stay those of your model.
        activation_checkpointing_policy: torch's selective per-op policy for those blocks, a
            `policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy` or a list of ops whose outputs
            are kept (`create_selective_checkpoint_contexts`); `None` recomputes everything.
        **ddp_kwargs: passed on to `torch.nn.parallel.DistributedDataParallel`.
    """

    name = "ddp"
    is_distributed = True
    needs_process_group = True
    # DistributedDataParallel fixes its gradient buckets and buffer list when it is built, and
    # fully_shard (FSDPStrategy) its all-gather buffers at the first forward; neither shards or
    # reduces a parameter added later.
    follows_conversions = False
    follows_new_parameters = False
    #: `None` re-runs the script; otherwise a `multiprocessing` start method.
    start_method: ClassVar[str | None] = None

    def __init__(self, timeout: float | timedelta | None = None,
                 process_group_backend: str | None = None, activation_checkpointing: Any = None,
                 activation_checkpointing_policy: Any = None, **ddp_kwargs: Any) -> None:
        super().__init__()
        self._recompute = recompute(activation_checkpointing, activation_checkpointing_policy)
        self._timeout = _as_timedelta(timeout)
        self._backend = process_group_backend
        self._ddp_kwargs = ddp_kwargs
        self._launcher: Launcher | None = None
        self._teardown_registered = False
        self._progress: CollectiveProgress | None = None
        #: Whether Lite created the default process group (one that existed before, e.g. Ray
        #: Train's, is reused and left to its owner at teardown).
        self._owns_process_group = False

    @property
    def timeout(self) -> timedelta:
        """How long a collective waits for the other ranks."""
        return self._timeout

    @property
    def process_group_backend(self) -> str | None:
        """The `torch.distributed` backend of the process group: the one passed, else the accelerator's."""
        assert self.accelerator is not None
        return self._backend or self.accelerator.distributed_backend

    @property
    def launcher(self) -> Launcher | None:
        assert self.environment is not None
        if self.environment.creates_processes_externally:
            return self._launcher if self.start_method is None else None
        if len(self.device_indexes) * self.num_nodes == 1:
            return None  # the job is this process: nothing to start, so stdin and notebooks work too
        if self._launcher is None:
            self._launcher = self._build_launcher()
        return self._launcher

    def _build_launcher(self) -> Launcher:
        assert self.environment is not None
        if self.start_method is None:
            from lite_core.launchers.script import ScriptLauncher

            return ScriptLauncher(self.environment, len(self.device_indexes), self.num_nodes, strategy_name=self.name)
        from lite_core.launchers.multiprocessing import MultiprocessingLauncher

        return MultiprocessingLauncher(self, self.start_method)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_launcher"] = None  # holds processes and threads; never sent to a worker
        state["_progress"] = None
        return state

    # -- ranks -----------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self._env().global_rank()

    @property
    def local_rank(self) -> int:
        return self._env().local_rank()

    @property
    def node_rank(self) -> int:
        return self._env().node_rank()

    @property
    def world_size(self) -> int:
        return self._env().world_size()

    def _env(self) -> Any:
        assert self.environment is not None
        return self.environment

    def sync_ranks(self) -> None:
        """Tell the environment the world size and this process's global rank."""
        env = self._env()
        per_node = len(self.device_indexes)
        env.set_world_size(per_node * self.num_nodes)
        env.set_global_rank(env.node_rank() * per_node + env.local_rank())

    # -- environment -------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        if self._environment_ready:
            return
        one_process_here = self.launcher is None and not self._env().creates_processes_externally
        before = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")} if one_process_here else {}
        self.sync_ranks()
        super().setup_environment()
        if not dist.is_initialized():
            self._init_process_group()
            self._owns_process_group = True
        # A one-process job in this process leaves the variables as they were: a process started
        # from here later (a notebook's `!python train.py`) must not inherit the port, which this
        # process keeps while the group lives.
        restore_environ(before)
        self._progress = _progress_of(self.global_rank, self.world_size, self._timeout)
        if not self._teardown_registered:
            atexit.register(self.teardown)
            self._teardown_registered = True

    def _init_process_group(self) -> None:
        env = self._env()
        assert self.accelerator is not None
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        try:
            init_attempt_process_group(self.process_group_backend, env.main_address,
                                       env.main_port, self.global_rank, self.world_size, self._timeout)
        except RuntimeError as err:
            if self.global_rank == 0 and _is_port_in_use(err):
                raise ConfigurationError(
                    f"MASTER_PORT={env.main_port} is already in use on {env.main_address}, so rank 0 cannot"
                    " host the job there: stop the process that holds it, pick another free port, or unset"
                    " MASTER_PORT to let Lite choose one."
                ) from err
            raise

    def teardown(self, failed: bool = False) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        # A group Lite did not create is its owner's to end: Lite only waits for the ranks, once.
        ours = self._owns_process_group
        if dist.is_initialized() and (ours or self._environment_ready):
            if not (failed or self._failed):
                dist.barrier()
                settle_collectives(self.root_device)
            if ours:
                dist.destroy_process_group()
                self._owns_process_group = False
        super().teardown(failed)

    # -- model ---------------------------------------------------------------------------------------
    def _apply_recompute(self, module: nn.Module) -> nn.Module:
        """`module` with the `activation_checkpointing` blocks recomputed (in place; names unchanged)."""
        return module if self._recompute is None else self._recompute.apply(module)

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        module = self._apply_recompute(module)
        device = self.root_device
        device_ids = [device] if device.index is not None else None
        return DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)

    def no_backward_sync(self, module: nn.Module) -> ContextManager[Any]:
        if isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return nullcontext()

    # -- collectives -------------------------------------------------------------------------------
    def _collective(self, name: str, collective: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a collective; one that times out says which rank did not arrive."""
        if self._progress is None:
            return collective(*args, **kwargs)
        return self._progress.run(name, collective, *args, **kwargs)

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            self._collective("barrier", dist.barrier)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        self._collective("broadcast", dist.broadcast_object_list, holder, src=src)
        return holder[0]

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return self._collective("all_gather", tree_map_only, torch.Tensor,
                                lambda t: self._all_gather_one(t, group, sync_grads), tensor)

    def _all_gather_one(self, tensor: torch.Tensor, group: Any, sync_grads: bool) -> torch.Tensor:
        tensor = tensor.contiguous()
        _check_same_shape(tensor, group)
        if sync_grads:
            from torch.distributed.nn.functional import all_gather

            return torch.stack(all_gather(tensor, group=group or dist.group.WORLD))
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: str = "mean") -> Any:
        check_reduce_op(reduce_op)
        return self._collective("all_reduce", tree_map_only, torch.Tensor,
                                lambda t: self._all_reduce_one(t, group, reduce_op), tensor)

    def _all_reduce_one(self, tensor: torch.Tensor, group: Any, reduce_op: str) -> torch.Tensor:
        result = tensor.clone()
        dist.all_reduce(result, op=_REDUCE_OPS[reduce_op], group=group)
        if reduce_op == "mean":
            result = result / dist.get_world_size(group)
        return result

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timeout={self._timeout})"


class DDPSpawnStrategy(DDPStrategy):
    """`strategy="ddp_spawn"`: starts every rank with `multiprocessing` spawn."""

    name = "ddp_spawn"
    start_method = "spawn"


class DDPForkStrategy(DDPStrategy):
    """`strategy="ddp_fork"` / `"ddp_notebook"`: forks every rank; works from a Jupyter cell."""

    name = "ddp_fork"
    start_method = "fork"


def _check_same_shape(tensor: torch.Tensor, group: Any) -> None:
    """Raise the same `MisuseError` on every rank when the ranks' tensors differ in shape.

    One small all_gather of each rank's shape comes first, so that gloo or NCCL never see
    mismatched buffers (which aborts a rank or hangs the job)."""
    if tensor.dim() > _MAX_GATHER_DIMS:
        raise MisuseError(f"all_gather got a tensor with {tensor.dim()} dimensions: reshape it to at most"
                          f" {_MAX_GATHER_DIMS} dimensions before gathering.")
    padding = [-1] * (_MAX_GATHER_DIMS - tensor.dim())
    mine = torch.tensor([tensor.dim(), *tensor.shape, *padding], dtype=torch.int64, device=tensor.device)
    shapes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shapes, mine, group=group)
    if all(torch.equal(shape, mine) for shape in shapes):
        return
    described = ", ".join(f"rank {rank} has {tuple(shape[1:1 + int(shape[0])].tolist())}"
                          for rank, shape in enumerate(shapes))
    raise MisuseError(f"all_gather needs the same tensor shape on every rank but {described}: pad or trim the"
                      " tensors to one shape on every rank (e.g. with torch.nn.functional.pad) before gathering.")


def _progress_of(rank: int, world_size: int, timeout: timedelta) -> CollectiveProgress | None:
    """Progress sharing through the default process group's store, if torch exposes it."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return CollectiveProgress(store, rank, world_size, timeout)
    except Exception:  # a private torch helper: without it, timeouts keep torch's own message
        return None


def _is_port_in_use(err: RuntimeError) -> bool:
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        raw = os.environ.get(_TIMEOUT_VARIABLE, "").strip() or str(_DEFAULT_TIMEOUT_SECONDS)
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigurationError(
                f"{_TIMEOUT_VARIABLE}={raw!r} is not a number of seconds: set it to a number of seconds, e.g. 1800."
            ) from None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ConfigurationError(
            f"timeout={timeout!r} is not valid: pass a positive number of seconds (or a timedelta), e.g. timeout=1800."
        )
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
