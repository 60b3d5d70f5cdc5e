"""`strategy="diloco"` and `strategy="local_sgd"`: replica groups that train alone between syncs.

Each replica group is the same Lite job as under `ddp_ft` (DDP inside the group, the same
lighthouse and variables), but the groups meet only every `sync_every` inner steps, where torchft's
`torchft.local_sgd.DiLoCo` (or `LocalSGD`) puts the meeting: in a post-hook of the user's optimizer.
The user's `optimizer.step()` is the inner step; every `sync_every` of them, one quorum forms and

- `diloco`: each group's pseudo-gradient (the weights of the last sync minus its weights now) is
  averaged over the groups and an outer optimizer (Nesterov SGD by default, as in the DiLoCo paper)
  steps the weights of the last sync with it; every group goes on from the result;
- `local_sgd`: the groups' weights are averaged.

Manager(init_sync=False): the groups must start from the same weights (the same seed), which is
what both algorithms assume. torchft's default, `init_sync=True`, makes the first quorum copy one
group's weights into the others; here that quorum comes after `sync_every` local steps, so it would
copy one group's *trained* weights and the job would no longer compute the algorithm.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import SGD, Optimizer
from torch.utils._pytree import tree_map_only

from lite_core.plugins import ConfigurationError
from lite_torchft._replication import _local
from lite_torchft.algorithm import Algorithm, AlgorithmFSDPStrategy, AlgorithmStrategy

#: The DiLoCo paper's outer optimizer: SGD with Nesterov momentum 0.9 at learning rate 0.7.
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


class LocalSGD(Algorithm):
    """The groups' weights averaged every `sync_every` inner steps (arXiv 1805.09767), on
    torchft's `LocalSGD`.

    Args:
        sync_every: inner steps between averages.
    """

    def __init__(self, sync_every: int) -> None:
        super().__init__(sync_every)
        self._torchft: Any = None

    def build(self, manager: Any, model: nn.Module, optimizer: Optimizer) -> Any:
        from torchft.local_sgd import LocalSGD as TorchftLocalSGD

        self._torchft = TorchftLocalSGD(manager, model, optimizer, sync_every=self.sync_every)
        return self._torchft

    def state_dict(self) -> dict[str, Any]:
        """The inner steps since the last sync."""
        return {"local_step": self._torchft._local_step}  # torchft 0.2.0's counter

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._torchft._local_step = int(state["local_step"])


class DiLoCo(Algorithm):
    """DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512) on torchft's `DiLoCo`:
    every `sync_every` inner steps each group's pseudo-gradient (the weights of the last sync minus
    its weights now) is averaged over the groups and an outer optimizer steps the weights of the
    last sync with it; every group goes on from the result. Its arguments are `DiLoCoStrategy`'s,
    less the strategy's own (`**kwargs`).
    """

    def __init__(self, sync_every: int = 100, outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM,
                 outer_optimizer: Callable[[list[nn.Parameter]], Optimizer] | None = None, fragments: int = 1,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0,
                 should_quantize: bool = False) -> None:
        super().__init__(sync_every)
        if not isinstance(fragments, int) or fragments < 1 or sync_every % fragments:
            raise ConfigurationError(
                f"fragments={fragments!r} must be a whole number that divides sync_every={sync_every}."
            )
        if not 0 <= fragment_sync_delay < sync_every // fragments:
            raise ConfigurationError(
                f"fragment_sync_delay={fragment_sync_delay!r} must be at least 0 and below"
                f" sync_every / fragments = {sync_every // fragments}."
            )
        self._outer = outer_optimizer or (lambda params: SGD(params, lr=outer_lr, momentum=outer_momentum,
                                                                 nesterov=outer_momentum > 0))
        self.fragments = fragments
        self._options = {"fragment_sync_delay": fragment_sync_delay, "fragment_update_alpha": fragment_update_alpha,
                         "should_quantize": should_quantize}
        self._manager: Any = None
        self._torchft: Any = None
        self._fragment_modules: list[nn.Module] = []  # what `build` gave torchft, in its order
        self._outer_optimizers: list[Optimizer] = []

    def check(self, strategy: str, accelerator: str) -> None:
        if self._options["should_quantize"]:
            _require_quantizing_kernels(strategy, accelerator)

    def build(self, manager: Any, model: nn.Module, optimizer: Optimizer) -> Any:
        from torchft.local_sgd import DiLoCo as TorchftDiLoCo

        self._manager = manager
        self._fragment_modules = _split(model, self.fragments)
        self._outer_optimizers = [self._outer(list(f.parameters())) for f in self._fragment_modules]
        self._torchft = TorchftDiLoCo(manager, self._fragment_modules, optimizer, self._outer_optimizers,
                                      sync_every=self.sync_every, backup_device=None, pin_memory=False,
                                      **self._options)
        return self._torchft

    # torchft registers each fragment's outer optimizer and last synchronised weights with the
    # Manager (for healing) under these keys; a checkpoint holds them too, with the inner steps
    # since the last sync. torchft keeps this rank's part of a sharded parameter's tensors: the
    # checkpoint holds them whole (gathered while saving; see docs/regions.md), so that it loads
    # under another layout, and `load` takes this rank's part.
    def state_dict(self) -> dict[str, Any]:
        states = {}
        for index, fragment in enumerate(self._fragment_modules):
            key = f"StreamingDiLoCoFragment_{index}"
            state = self._manager._user_state_dicts[key]()  # torchft 0.2.0's registry of them
            layouts = dict(fragment.named_parameters())
            weights = {name: _whole(local, layouts[name]) for name, local in state["original_parameters"].items()}
            outer = tree_map_only(DTensor, lambda tensor: tensor.full_tensor(), state["outer_optimizer"])
            states[key] = {"original_parameters": weights, "outer_optimizer": outer}
        return {"fragments": states, "local_step": self._torchft._local_step}  # torchft 0.2.0's counter

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for index, (fragment, outer_optimizer) in enumerate(zip(self._fragment_modules, self._outer_optimizers)):
            key = f"StreamingDiLoCoFragment_{index}"
            saved = state["fragments"][key]
            layouts = dict(fragment.named_parameters())
            weights = {name: _local(_part(whole, layouts[name])) for name, whole in saved["original_parameters"].items()}
            parameters = [p for group in outer_optimizer.param_groups for p in group["params"]]
            outer = {**saved["outer_optimizer"], "state": {
                slot: {name: _part(value, parameters[slot]) for name, value in values.items()}
                for slot, values in saved["outer_optimizer"]["state"].items()}}
            self._manager._load_state_dict_fns[key]({"original_parameters": weights, "outer_optimizer": outer})
        self._torchft._local_step = int(state["local_step"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sync_every={self.sync_every}, fragments={self.fragments})"


class _DiLoCoArguments:
    """`DiLoCoStrategy`'s and `DiLoCoFSDPStrategy`'s arguments: `DiLoCo`'s, then the strategy's."""

    def __init__(self, sync_every: int = 100, outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM,
                 outer_optimizer: Callable[[list[nn.Parameter]], Optimizer] | None = None, fragments: int = 1,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0, should_quantize: bool = False,
                 **kwargs: Any) -> None:
        algorithm = DiLoCo(sync_every, outer_lr, outer_momentum, outer_optimizer, fragments, fragment_sync_delay,
                           fragment_update_alpha, should_quantize)
        super().__init__(algorithm, **kwargs)  # type: ignore[call-arg]  # the algorithm strategy's

    def __repr__(self) -> str:
        algorithm = self.algorithm  # type: ignore[attr-defined]
        return f"{type(self).__name__}(sync_every={algorithm.sync_every}, fragments={algorithm.fragments})"


def _require_quantizing_kernels(strategy: str, accelerator: str) -> None:
    """torchft quantizes the all-reduce only with its Triton kernels on CUDA devices, and otherwise
    all-reduces unquantized without a word: say so at construction instead."""
    import importlib.util

    if accelerator != "cuda":
        raise ConfigurationError(
            f"{strategy}(should_quantize=True) quantizes with torchft's Triton kernels, which run on CUDA"
            f" GPUs only, so on accelerator={accelerator!r} nothing would be quantized: pass should_quantize=False."
        )
    if importlib.util.find_spec("triton") is None:
        raise ConfigurationError(
            f"{strategy}(should_quantize=True) quantizes with torchft's Triton kernels, and Triton is not"
            " installed, so nothing would be quantized: run `pip install triton` or pass should_quantize=False."
        )


class DiLoCoStrategy(_DiLoCoArguments, AlgorithmStrategy):
    """`strategy="diloco"`: DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512)
    across replica groups, on torchft's `DiLoCo`, with DDP inside each group.

    Args:
        sync_every: inner steps (the user's `optimizer.step()` calls) between outer steps (H).
        outer_lr: the outer SGD's learning rate (0.7 by default, as in the paper).
        outer_momentum: the outer SGD's Nesterov momentum (0.9; 0 for none).
        outer_optimizer: instead of those two, a function from a list of parameters to the outer
            optimizer (one per fragment).
        fragments: Streaming DiLoCo: the model's top-level children split into this many
            consecutive fragments, synchronised in turn, one every `sync_every / fragments` steps.
        fragment_sync_delay: inner steps between sending a fragment's pseudo-gradient and using
            the average (the paper's tau; less than `sync_every / fragments`).
        fragment_update_alpha: how much of the group's own weights a synchronised fragment keeps
            (0: it takes the outer step's result).
        should_quantize: all-reduce the pseudo-gradients quantized (torchft's Triton kernels: CUDA GPUs
            only; refused at construction elsewhere, where torchft would not quantize).
        **kwargs: `ddp_ft`'s arguments (timeouts, `min_replica_size`, ...), and `ddp`'s for the group.
    """

    name = "diloco"


class DiLoCoFSDPStrategy(_DiLoCoArguments, AlgorithmFSDPStrategy):
    """`strategy="diloco_fsdp"`: `diloco` with FSDP2 inside each replica group.

    Each group shards the model with `fully_shard`; at a sync rank r of every group averages its
    shard of the pseudo-gradient with rank r of the other groups, and steps its shard of the outer
    optimizer (as `fsdp_ft` averages gradients). Every group must have as many processes. Takes
    `strategy="diloco"`'s arguments and `strategy="fsdp"`'s for the group.
    """

    name = "diloco_fsdp"


class LocalSGDStrategy(AlgorithmStrategy):
    """`strategy="local_sgd"`: the groups' weights averaged every `sync_every` inner steps
    (arXiv 1805.09767), on torchft's `LocalSGD`.

    Args:
        sync_every: inner steps between averages.
        **kwargs: `ddp_ft`'s arguments, and `ddp`'s for the group.
    """

    name = "local_sgd"

    def __init__(self, sync_every: int = 100, **kwargs: Any) -> None:
        super().__init__(LocalSGD(sync_every), **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sync_every={self.algorithm.sync_every})"


def _split(model: nn.Module, count: int) -> list[nn.Module]:
    """The model as `count` fragments: itself, or its top-level children in consecutive runs."""
    if count == 1:
        return [model]
    children = list(model.children())
    if len(children) < count or any(True for _ in model.parameters(recurse=False)):
        raise ConfigurationError(
            f"fragments={count} needs a model with at least {count} top-level submodules and no parameters of"
            f" its own ({type(model).__name__} has {len(children)}): lower `fragments` or nest the layers."
        )
    bounds = [round(i * len(children) / count) for i in range(count + 1)]
    return [nn.ModuleList(children[bounds[i]:bounds[i + 1]]) for i in range(count)]


def _whole(local: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `local` is this rank's part, laid out as `parameter` is (gathered
    from every rank of its mesh for a sharded parameter)."""
    if not isinstance(parameter, DTensor):
        return local
    laid_out = DTensor.from_local(local, parameter.device_mesh, parameter.placements, shape=parameter.shape,
                                  stride=parameter.stride())
    return laid_out.full_tensor()


def _part(whole: Any, parameter: torch.Tensor) -> Any:
    """A whole tensor shaped as `parameter`, laid out as it is (a `DTensor` of its mesh and
    placements, cut from this rank's copy without communication); anything else as it is."""
    if not isinstance(parameter, DTensor) or not isinstance(whole, torch.Tensor) or whole.shape != parameter.shape:
        return whole
    return distribute_tensor(whole, parameter.device_mesh, parameter.placements, src_data_rank=None)
