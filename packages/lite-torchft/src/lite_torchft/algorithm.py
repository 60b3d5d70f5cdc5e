"""The fault-tolerance algorithm interface: replica groups that train alone and meet every few steps.

An `Algorithm` says what happens when the groups meet; `AlgorithmStrategy` (DDP inside each
group) and `AlgorithmFSDPStrategy` (FSDP2 inside each group) run it, with everything else of
`ddp_ft`: the lighthouse and the variables, torchft's `Manager`, healing a group that starts
again, the set-up loaders' positions and the checkpoints. `strategy="diloco"`, `"diloco_fsdp"` and
`"local_sgd"` are these strategies with the algorithms of `lite_torchft.diloco`.

The groups must start from the same weights (the same seed): the `Manager` is built with
`init_sync=False`, because its first quorum comes after local steps and would otherwise copy one
group's *trained* weights into the others.
"""

from __future__ import annotations

from typing import Any, ClassVar, ContextManager

from torch import nn
from torch.optim import Optimizer

from lite_core.plugins import CheckpointIO, ConfigurationError, DDPStrategy, FSDPStrategy, Precision
from lite_torchft._replication import ReplicaGroups
from lite_torchft._variables import read_variables


class Algorithm:
    """Base class of a fault-tolerance algorithm: what replica groups do when they meet, every
    `sync_every` inner steps (the user's `optimizer.step()` calls), through torchft's `Manager`.

    The strategy calls these hooks, and only these:

    - `check(strategy, accelerator)` when the `LightningLite` is built: raise a
      `ConfigurationError` for what cannot run there. By default nothing is refused.
    - `build(manager, model, optimizer)` once, when the user's one optimizer is set up: return the
      object that runs the algorithm (torchft's `LocalSGD` or `DiLoCo`, or a context manager of
      your own); the strategy enters it for the rest of the job. It usually registers optimizer
      hooks (`optimizer.register_step_post_hook`) that count the inner steps and, every
      `sync_every` of them, sync: `manager.start_quorum()` (a group that starts again heals here
      from a peer), `manager.allreduce(tensor)` (the mean over the groups in the quorum), and
      `manager.should_commit()` before the result is applied. A peer that heals from this group
      reads its state while the sync runs: call `manager.disallow_state_dict_read()` before the
      optimizer changes the weights (a pre-hook) and `manager.allow_state_dict_read()` before the
      sync, as torchft's algorithms do.
    - `state_dict()` when a checkpoint is saved and `load_state_dict(state)` when one is loaded:
      what the checkpoint holds for the algorithm (the inner steps since the last sync, say), a
      dict of tensors and plain values. By default nothing.

    A group that heals receives every set-up model, optimizer and loader position and the step
    count from its peer. State of the algorithm's own that a healed group needs (an outer
    optimizer, the weights of the last sync) is registered in `build` with
    `manager.register_state_dict_fn(key, load_state_dict, state_dict)`.

    An instance runs one job. docs/backends/torchft.md writes a second algorithm on it.

    Args:
        sync_every: inner steps between syncs, 1 or more.
    """

    def __init__(self, sync_every: int) -> None:
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ConfigurationError(f"sync_every={sync_every!r} must be a whole number of inner steps, 1 or more.")
        self.sync_every = sync_every

    def check(self, strategy: str, accelerator: str) -> None:
        """Refuse, with a `ConfigurationError`, what cannot run under the strategy class named
        `strategy` on the accelerator named `accelerator` (`"cpu"`, `"cuda"`, ...)."""

    def build(self, manager: Any, model: nn.Module, optimizer: Optimizer) -> ContextManager[Any]:
        """The object that runs the algorithm on `model` (the set-up model; several set-up models
        come as one `nn.ModuleList`) and `optimizer` (the user's inner optimizer) with torchft's
        `manager`; entered once, for the rest of the job."""
        raise NotImplementedError(f"{type(self).__name__} must define build(manager, model, optimizer).")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds for the algorithm (after `build`)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what `state_dict` returned (after `build`)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sync_every={self.sync_every})"


class _AlgorithmReplication(ReplicaGroups):
    """The torchft part of a strategy that runs an `Algorithm`, mixed into the group's own strategy:
    no quorum per step; the algorithm's hooks on the one set-up optimizer open a quorum when the
    groups meet; loaders share each batch over the groups of the last quorum (before the first
    one: every group, as the variables say)."""

    _init_sync: ClassVar[bool] = False  # the first quorum comes after local steps (module docstring)
    _groups_agree_at_save: ClassVar[bool] = False  # between syncs each group holds its own weights
    # `backward` is the group strategy's, without the per-step quorum of `ddp_ft`; kept routed through the strategy.
    changes_backward: ClassVar[bool] = True
    steps_optimizers_plainly: ClassVar[bool] = False  # `optimizer_step` moves the loaders' streams on

    def __init__(self, algorithm: Algorithm, **kwargs: Any) -> None:
        if not isinstance(algorithm, Algorithm):
            raise ConfigurationError(
                f"{type(self).__name__} takes a lite_torchft.Algorithm, not {type(algorithm).__name__}:"
                " subclass lite_torchft.Algorithm and pass an instance."
            )
        super().__init__(**kwargs)
        self._algorithm_hooks = algorithm
        self._algorithm: Any = None  # what `algorithm.build` returned, entered at `setup_optimizer`
        self._last_quorum = -1
        self._group = (0, 1)  # this group's index and the groups' number until the first quorum

    @property
    def algorithm(self) -> Algorithm:
        """The algorithm this strategy runs."""
        return self._algorithm_hooks

    def connect(self, accelerator: Any, *args: Any, **kwargs: Any) -> None:
        self._algorithm_hooks.check(type(self).__name__, accelerator.name)
        super().connect(accelerator, *args, **kwargs)

    def _build_manager(self, group_id: int, lighthouse: str) -> Any:
        self._group = (group_id, read_variables().num_groups)
        return super()._build_manager(group_id, lighthouse)

    def _group_module(self, module: nn.Module, precision: Precision) -> nn.Module:
        return module if self.world_size == 1 else super()._group_module(module, precision)

    # -- the step: no quorum of its own --------------------------------------------------------------
    def _begin_step(self) -> tuple[int, int]:
        """This process's index among the processes of the last sync's groups, and their number."""
        manager = self._manager
        if manager is not None and manager._quorum_id != self._last_quorum:  # torchft 0.2.0's quorum id
            self._last_quorum = manager._quorum_id
            self._group = (manager.participating_rank() or 0, max(manager.num_participants(), 1))
        group, groups = self._group
        return group * self.world_size + self.global_rank, groups * self.world_size

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._algorithm is not None:
            raise ConfigurationError(
                f"strategy={self.name!r} takes one optimizer (the inner one), set up once: put every"
                " parameter group into that optimizer."
            )
        if not self._healing.modules:
            raise ConfigurationError(
                f"strategy={self.name!r} needs the model set up before or with its optimizer:"
                " call `self.setup(model, optimizer)`."
            )
        optimizer = super().setup_optimizer(optimizer)
        self._algorithm = self._algorithm_hooks.build(self._manager, self._model(), optimizer)
        self._algorithm.__enter__()  # its hooks on the optimizer stay for the job
        return optimizer

    def _model(self) -> nn.Module:
        modules = self._healing.modules
        return modules[0] if len(modules) == 1 else nn.ModuleList(modules)

    def optimizer_step(self, optimizer: Optimizer, *, precision: Precision, **kwargs: Any) -> Any:
        """The inner step (the algorithm's hooks sync when due). The loaders move on first: a peer
        that heals from this group in that sync takes the position after this step."""
        for stream in self._healing.streams:
            stream.commit()
        return super().optimizer_step(optimizer, precision=precision, **kwargs)

    # -- checkpoints: what the algorithm's `state_dict` returns ---------------------------------------
    def _with_manager(self, content: dict[str, Any]) -> dict[str, Any]:
        content = super()._with_manager(content)
        if self._algorithm is None:
            return content
        return {**content, _ALGORITHM_KEY: self._algorithm_hooks.state_dict()}

    def load_checkpoint(self, path: str, state: dict[str, Any] | None = None, strict: bool = True,
                        weights_only: bool = True, *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> dict[str, Any]:
        content = super().load_checkpoint(path, state, strict, weights_only, checkpoint_io=checkpoint_io,
                                          precision=precision)
        saved = content.pop(_ALGORITHM_KEY, None)
        if saved is not None and self._algorithm is not None:
            self._algorithm_hooks.load_state_dict(saved)
        return content

    def __repr__(self) -> str:
        return f"{type(self).__name__}(algorithm={self._algorithm_hooks!r})"


class AlgorithmStrategy(_AlgorithmReplication, DDPStrategy):
    """A fault-tolerance `Algorithm` across replica groups, DDP inside each group (nothing inside a
    group of one process): `LightningLite(strategy=AlgorithmStrategy(MyAlgorithm(sync_every=50)))`.

    Args:
        algorithm: what the groups do when they meet.
        **kwargs: `ddp_ft`'s arguments (timeouts, `min_replica_size`, ...), and `ddp`'s for the group.
    """

    name = "ft_algorithm"


class AlgorithmFSDPStrategy(_AlgorithmReplication, FSDPStrategy):
    """`AlgorithmStrategy` with FSDP2 (`fully_shard`) inside each replica group: the model's
    parameters the algorithm sees are this rank's shards (`DTensor`s), and rank r of every group
    meets rank r of the others. Every group must have as many processes.

    Args:
        algorithm: what the groups do when they meet.
        **kwargs: `ddp_ft`'s arguments, and `fsdp`'s for the group.
    """

    name = "ft_algorithm_fsdp"


_ALGORITHM_KEY = "_torchft_diloco"  # the algorithm's state in a checkpoint (named when DiLoCo was the only one)
