"""Fault-tolerant replication across replica groups on torchft, for any data-parallel strategy inside a group.

Each replica group is an ordinary Lite job (one or more processes, started by `python`, `lite run`
or torchrun) running its own strategy (`ddp`, or `fsdp` for HSDP) over its own process group.
Across groups, torchft's `Manager` runs the steps: a quorum per step from the lighthouse, the
gradients averaged over the groups alive in the step (rank r of every group over its own
reconfigurable gloo group, so a sharded model averages its shards), and `should_commit` deciding
whether the optimizers step. A group that dies is dropped; a group that starts again heals at the
next quorum from a peer's state (see `HealingState`), sent by torchft's checkpoint transport.

The step opens at the first of: the next batch of a set-up loader, a training forward pass of a
set-up model, `backward`; it is decided at the first `optimizer.step()` after its backward.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar, Iterable, Iterator

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core.plugins import CheckpointIO, LiteError, Precision, store_for
from lite_torchft._healing import HealingState
from lite_torchft._stream import LoaderStream
from lite_torchft._variables import check_lighthouse, read_variables

#: Defaults chosen so that a dead group is dropped within seconds on one machine (docs/launching.md).
FT_TIMEOUT_SECONDS = 10.0
QUORUM_TIMEOUT_SECONDS = 60.0
CONNECT_TIMEOUT_SECONDS = 10.0
MAX_COMMIT_FAILURES = 10


class ReplicaGroups:
    """What every torchft strategy shares, mixed into the group's own strategy class: the
    lighthouse and the variables, torchft's `Manager`, the healing state, the set-up loaders'
    streams and the checkpoints. When the groups meet is the subclass's: every step
    (`FaultTolerantReplication`) or every few inner steps (`lite_torchft.algorithm`).

    Args:
        split_batches: deprecated, means `setup_dataloaders(loader, split_batches=True)` for every
            set-up loader (each loader batch is the step's global batch, split over every process
            alive in the step); pass the flag to `setup_dataloaders` instead.
        ft_timeout: seconds a cross-group all-reduce, commit vote or healing transfer may take
            before the step is given up (a dead peer is usually noticed at once, when its
            sockets close; this bounds the rest).
        quorum_timeout: seconds to wait for the lighthouse's quorum.
        connect_timeout: seconds to reach the lighthouse and the peers' managers.
        min_replica_size: the fewest groups a step may commit with.
        max_commit_failures: consecutive steps that may fail to commit before this group gives up
            with an error.
        **kwargs: the group strategy's own arguments.
    """

    # The group strategy's declarations (`lite_core.plugins.Strategy`) for the methods this overrides.
    stages_checkpoints: ClassVar[bool] = True  # `stage_checkpoint` stages what `save_checkpoint` writes
    #: torchft's `Manager(init_sync=...)`: whether the first quorum copies one group's weights to the
    #: others. Per-step replication quorums before any step, so it copies the initial weights; a
    #: strategy whose first quorum comes after local steps turns it off (see `lite_torchft.diloco`).
    _init_sync: ClassVar[bool] = True
    #: Whether the groups hold the same state whenever the user saves (after each committed step of
    #: per-step replication), so that one group's checkpoint at a URL stands for all of them.
    _groups_agree_at_save: ClassVar[bool] = True

    def __init__(self, split_batches: bool = False, ft_timeout: float = FT_TIMEOUT_SECONDS,
                 quorum_timeout: float = QUORUM_TIMEOUT_SECONDS, connect_timeout: float = CONNECT_TIMEOUT_SECONDS,
                 min_replica_size: int = 1, max_commit_failures: int = MAX_COMMIT_FAILURES, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if split_batches:
            warnings.warn(
                f"{type(self).__name__}(split_batches=True) is deprecated: pass"
                " setup_dataloaders(loader, split_batches=True), which the strategy splits per step.",
                FutureWarning, stacklevel=2,
            )
        self.split_batches = split_batches
        self._ft_timeout = timedelta(seconds=ft_timeout)
        self._quorum_timeout = timedelta(seconds=quorum_timeout)
        self._connect_timeout = timedelta(seconds=connect_timeout)
        self._min_replica_size = min_replica_size
        self._max_commit_failures = max_commit_failures
        self._manager: Any = None
        self._healing = HealingState()
        self._wrapped: list[nn.Module] = []
        self._global_batch_loaders: list[Iterable[Any]] = []  # set up with split_batches=True
        self._first_group = False  # whether this is group 0 (the logging group until the first quorum)
        self._runs = 0  # the user's `run()` calls in progress (`run_context`)
        self._left = False  # whether this group has left the job (`_leave`)

    # -- environment -------------------------------------------------------------------------------
    def connect(self, *args: Any, **kwargs: Any) -> None:
        read_variables()  # at construction: a missing or wrong variable is one sentence, before anything starts
        super().connect(*args, **kwargs)

    def setup_environment(self) -> None:
        if self._environment_ready:
            return
        variables = read_variables()
        if self.global_rank == 0 or self.launcher is None:
            check_lighthouse(variables.lighthouse, self._connect_timeout.total_seconds())
        super().setup_environment()
        self._first_group = variables.group_id == 0
        self._manager = self._build_manager(variables.group_id, variables.lighthouse)

    def _build_manager(self, group_id: int, lighthouse: str) -> Any:
        from torchft import Manager

        store_addr, store_port = _group_store_address()
        return Manager(
            pg=self._across_groups(),
            load_state_dict=self._healing.load_state_dict,
            state_dict=self._healing.state_dict,
            min_replica_size=self._min_replica_size,
            use_async_quorum=False,  # heal before the step's forward pass, so every group computes on healed weights
            timeout=self._ft_timeout,
            quorum_timeout=self._quorum_timeout,
            connect_timeout=self._connect_timeout,
            rank=self.global_rank,
            world_size=self.world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"lite_ddp_ft_{group_id}",
            max_retries=self._max_commit_failures,
            init_sync=self._init_sync,
        )

    def _across_groups(self) -> Any:
        """torchft's process group between the groups (a rank with the same rank of every other
        group), on the backend of the group's own process group: NCCL where the accelerator declares
        it (CUDA, as torchft's own examples choose), so that the per-step all-reduce of CUDA
        gradients stays on the GPUs; gloo otherwise."""
        import torchft

        kind = torchft.ProcessGroupNCCL if self.process_group_backend == "nccl" else torchft.ProcessGroupGloo
        return kind(timeout=self._ft_timeout)

    @contextmanager
    def run_context(self) -> Iterator[None]:
        """The user's `run()`; when it ends, this group leaves the job (see `_leave`)."""
        self._runs += 1
        try:
            with super().run_context():
                yield
        finally:
            self._runs -= 1
            if not self._runs:
                self._leave()

    def _leave(self) -> None:
        """Stop torchft's `Manager`: its heartbeats and its checkpoint server. A group whose `run()`
        has ended asks for no more quorums, but while its process lives on (a Ray worker waiting for
        its peers, a script that goes on after `run()`) its heartbeats would count it as alive, and
        the lighthouse forms no quorum without a majority of the groups it sees alive: a group still
        training, or one started again late, would wait out its quorum timeout for it. What the group
        has read from the Manager (its step, its place in the last quorum) stays readable."""
        if self._manager is not None and not self._left:
            self._left = True
            self._manager.shutdown(wait=False)

    def teardown(self, failed: bool = False) -> None:
        self._leave()
        self._manager = None
        super().teardown(failed)

    @property
    def manager(self) -> Any:
        """torchft's `Manager` of this process (after the environment is set up)."""
        return self._manager

    @property
    def step(self) -> int:
        """Committed steps of the whole job (a healed group takes its peer's count)."""
        return 0 if self._manager is None else self._manager.current_step()

    def is_logging_process(self) -> bool:
        """Rank 0 of the group that is first in the last quorum (group 0 before any), so that the job
        logs once and the logging moves to a live group when that one dies (and back when it returns)."""
        return self.global_rank == 0 and self._first_in_quorum()

    def logging_round(self) -> int | None:
        """The job's committed steps (`step`): the logging group is chosen at each quorum, and each
        quorum that commits moves the count on (every step under `ddp_ft`, every sync under DiLoCo;
        torchft's quorum id moves only when the groups change). So a group that is not logging keeps
        what it logs since the last commit, and sends what the tracker lacks if it becomes first at
        the next (its predecessor died, say, between two syncs)."""
        return None if self._manager is None else self.step

    def carry_in_heals(self, name: str, state: Any) -> None:
        """A group that heals takes `state`'s `state_dict()` from its peer along with the model
        (see `HealingState`)."""
        self._healing.carried[name] = state

    def _first_in_quorum(self) -> bool:
        """Whether this group is first in the last quorum (group 0 before any); every process of a
        group gets the same answer."""
        first = None if self._manager is None else self._manager.participating_rank()
        return self._first_group if first is None else first == 0

    def fault_tolerance_figures(self) -> dict[str, float]:
        """`fault/replica_groups`, the groups in the last quorum (fewer while a group is down), and
        `fault/heals`, the times this group took its state from a peer: `ThroughputMonitor` logs both."""
        if self._manager is None:
            return {}
        return {"fault/replica_groups": float(self._manager.num_participants()),
                "fault/heals": float(self._healing.heals)}

    # -- the step ----------------------------------------------------------------------------------
    def _begin_step(self) -> tuple[int, int]:
        """This process's index among the processes of the groups that share the step's batches,
        and their number (asked at the step's first batch, forward pass and backward)."""
        raise NotImplementedError

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        wrapped = self._group_module(module, precision)
        self._healing.modules.append(module)
        self._wrapped.append(wrapped)
        wrapped.register_forward_pre_hook(self._before_forward)
        return wrapped

    def _group_module(self, module: nn.Module, precision: Precision) -> nn.Module:
        """The module as the group's own strategy sets it up (DDP, FSDP)."""
        return super().setup_module(module, precision=precision)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._begin_step()

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._healing.optimizers.append(optimizer)
        return optimizer

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        if not self._training_pass():
            return dataloader  # an evaluation pass: this group alone, outside the quorum
        return self._stream_of(dataloader).batches(self._begin_step)

    def _training_pass(self) -> bool:
        """Whether a pass starting now trains (takes part in the quorum): gradients enabled and a
        set-up model in training mode, as for a forward pass that opens the step."""
        return torch.is_grad_enabled() and (not self._wrapped or any(m.training for m in self._wrapped))

    def take_global_batches(self, dataloader: Iterable[Any]) -> bool:
        """`setup_dataloaders(dataloader, split_batches=True)`: each of its batches is a step's
        global batch, which the stream splits over the processes alive in the step."""
        self._global_batch_loaders.append(dataloader)
        return True

    def loader_batches_consumed(self, dataloader: Iterable[Any]) -> int | None:
        """The batches of `dataloader`'s epoch that committed steps took (its stream's count: every
        process's share of a step, none of a step that did not commit); `None` before its first pass."""
        stream = next((stream for stream in self._healing.streams if stream.dataloader is dataloader), None)
        return None if stream is None else stream.committed

    def resume_loader(self, dataloader: Iterable[Any], epoch: int, batches: int) -> bool:
        """A set-up loader's saved position (the user put the loader in the state they `load`)
        moves its stream, which skips the committed batches itself: the sampler must not too."""
        self._stream_of(dataloader).load_state_dict({"epoch": epoch, "committed": batches})
        return True

    def _stream_of(self, dataloader: Iterable[Any]) -> LoaderStream:
        for stream in self._healing.streams:
            if stream.dataloader is dataloader:
                return stream
        split = self.split_batches or any(loader is dataloader for loader in self._global_batch_loaders)
        stream = LoaderStream(dataloader, split)
        self._healing.add_stream(stream)
        return stream

    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        return None  # every process iterates the loader as one plain process does; the stream shares it

    def evaluation_sampler_kwargs(self) -> dict[str, int] | None:
        # each group evaluates the whole set, shared over its own processes (as under `ddp`), so
        # `all_reduce` / `gather_for_metrics`, which run within the group, count every sample once
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> None:
        if self._another_group_uploads(path):
            return
        super().save_checkpoint(path, self._with_manager(content), checkpoint_io=checkpoint_io, precision=precision)

    def stage_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                         precision: Precision) -> Any:
        if self._another_group_uploads(path):
            return _nothing
        return super().stage_checkpoint(path, self._with_manager(content), checkpoint_io=checkpoint_io,
                                        precision=precision)

    def _another_group_uploads(self, path: str) -> bool:
        """Whether another group writes the checkpoint at `path`: at a URL, which every group sees,
        only the first group of the last quorum writes (the others would upload the same bytes to
        the same keys at the same time); a local path is each group's own (each node its copy)."""
        return type(self)._groups_agree_at_save and store_for(path).shared and not self._first_in_quorum()

    def _with_manager(self, content: dict[str, Any]) -> dict[str, Any]:
        if self._manager is None:
            return content
        return {**content, _MANAGER_KEY: self._manager.state_dict(),
                _LOADERS_KEY: [stream.state_dict() for stream in self._healing.streams]}

    def load_checkpoint(self, path: str, state: dict[str, Any] | None = None, strict: bool = True,
                        weights_only: bool = True, *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> dict[str, Any]:
        content = super().load_checkpoint(path, state, strict, weights_only, checkpoint_io=checkpoint_io,
                                          precision=precision)
        manager_state, loaders = content.pop(_MANAGER_KEY, None), content.pop(_LOADERS_KEY, None)
        if manager_state is not None and self._manager is not None:
            self._manager.load_state_dict(manager_state)
        if loaders is not None:
            self._healing.load_positions(loaders, resumed=True)
        return content


class FaultTolerantReplication(ReplicaGroups):
    """The torchft part of `ddp_ft` and `fsdp_ft`, mixed into the group's own strategy class: a
    quorum every step, the gradients averaged over the groups alive in it, and `should_commit`
    deciding whether the optimizers step. Takes `ReplicaGroups`' arguments.
    """

    changes_backward: ClassVar[bool] = True  # `backward` opens the step's quorum
    steps_optimizers_plainly: ClassVar[bool] = False  # `optimizer_step` averages across groups and votes

    # The step's state, set on the instance by `_begin_step` and `optimizer_step` (no `__init__`
    # of its own, so that the deprecation warning of `split_batches` points at the user's call).
    _open = False  # a quorum was started for the step in progress
    _decision: bool | None = None  # the step's commit vote, once taken
    _share = (0, 1)  # this process's index among the step's processes, and their number

    def _begin_step(self) -> tuple[int, int]:
        """Open the step's quorum once (healing from a peer if due); returns this process's index
        among the processes alive in the step and their number."""
        if not self._open or self._decision is not None:
            self._open, self._decision = True, None
            try:
                self._manager.start_quorum()
            except Exception as err:  # the lighthouse is the job's single point of failure
                raise LiteError(
                    f"The torchft lighthouse stopped answering ({err}): it is the job's single point of failure;"
                    " restart it and every replica group (their checkpoints hold the Manager's state)."
                ) from err
            replica_rank = self._manager.participating_rank() or 0
            groups = max(self._manager.num_participants(), 1)
            self._share = replica_rank * self.world_size + self.global_rank, groups * self.world_size
        return self._share  # asked several times a step (batch, forward, backward, step): once per quorum

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, precision: Precision,
                 **kwargs: Any) -> None:
        self._begin_step()
        super().backward(tensor, module, *args, precision=precision, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, *, precision: Precision, **kwargs: Any) -> Any:
        if self._decision is None:
            self._begin_step()
            self._average_across_groups()
            self._decision = self._manager.should_commit()
            for stream in self._healing.streams:
                stream.commit() if self._decision else stream.abort()
        return super().optimizer_step(optimizer, precision=precision, **kwargs) if self._decision else None

    def _average_across_groups(self) -> None:
        """Average every set-up model's gradients over the groups alive in the step (one all-reduce;
        a sharded gradient averages this rank's shard with the same shard of the other groups)."""
        grads = [_local(p.grad) for m in self._healing.modules for p in m.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        self._manager.allreduce(flat).wait()
        for grad, averaged in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(split_batches={self.split_batches}, ft_timeout={self._ft_timeout})"


def _group_store_address() -> tuple[str, int]:
    """Host and port of the TCPStore under the group's process group, where torchft's Manager
    publishes the group's manager address (rank 0) for the other ranks."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.host, store.port


def _nothing() -> None:
    """The rest of a background save that another group writes."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (the local shard of a `DTensor`; any other tensor itself)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


_MANAGER_KEY = "_torchft_manager"
_LOADERS_KEY = "_torchft_loaders"
