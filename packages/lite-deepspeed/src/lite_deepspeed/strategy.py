"""`strategy="deepspeed"`: DeepSpeed ZeRO on the processes that the DDP launcher starts."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, ContextManager

import torch
from torch import nn
from torch.optim import Optimizer

from lite_core.plugins import (
    CheckpointIO,
    ConfigurationError,
    DDPStrategy,
    MisuseError,
    Precision,
    PrecisionSupport,
    export_environ,
    precision_entry,
    read_checkpoint,
    restore_environ,
)
from lite_deepspeed import _checkpoint, _config
from lite_deepspeed._guard import BackwardGuard
from lite_deepspeed.optimizer import DeepSpeedEngineOptimizer
from lite_deepspeed.precision import DeepSpeedPrecision

#: Lite accelerator name -> the `DS_ACCELERATOR` DeepSpeed uses for it.
_DS_ACCELERATORS = {"cpu": "cpu", "cuda": "cuda"}


class DeepSpeedStrategy(DDPStrategy):
    """DeepSpeed ZeRO: optimizer state (stage 1), gradients (2) and parameters (3) sharded over the
    processes, optionally offloaded to the CPU.

    Pass either keyword options or a full DeepSpeed `config`; Lite adds the fp16/bf16 section for
    the chosen precision and, unless the config sets one, the micro-batch size of the first
    dataloader iterated. Under stage 3, a model built inside `init_module()` is partitioned as it
    is created (`deepspeed.zero.Init`); one built elsewhere is partitioned by `setup`, and the
    rest of `run()` sees plain torch (default dtype and device, the user's generators).

    Args:
        stage: ZeRO stage, 0-3 (default 2).
        offload_optimizer: keep optimizer state and step on the CPU (stage 2 or 3).
        offload_parameters: keep parameters on the CPU (stage 3).
        allgather_bucket_size: elements per all-gather bucket (stages 1-2).
        reduce_bucket_size: elements per gradient-reduction bucket.
        overlap_comm: overlap gradient reduction with the backward pass.
        contiguous_gradients: copy gradients into one contiguous buffer as they are produced.
        pin_memory: pin the CPU memory of offloaded tensors (faster copies to a GPU).
        config: a DeepSpeed config as a dict or a JSON file path, instead of the options above.
        logging_level: level of DeepSpeed's logger.
        timeout: how long a collective waits for the other ranks (see `DDPStrategy`).
        process_group_backend: overrides the accelerator's `torch.distributed` backend.
    """

    name = "deepspeed"
    supported_accelerators: ClassVar[frozenset[str] | None] = frozenset(_DS_ACCELERATORS)
    #: DeepSpeed's fp16/bf16 modes (`_config.DTYPE_SECTIONS`): float32 or bfloat16 weights, and
    #: autocast in float16 or bfloat16.
    precision_support = PrecisionSupport(families=frozenset({"true", "mixed"}),
                                         true_dtypes=frozenset({torch.float32, torch.bfloat16}))
    precision_type = DeepSpeedPrecision  # the engine applies the dtype; Lite only casts inputs
    backward_needs_model = True
    changes_backward: ClassVar[bool] = True  # the engine runs the backward pass
    steps_optimizers_plainly: ClassVar[bool] = False  # the engine steps
    stages_checkpoints: ClassVar[bool] = False  # the engine writes its own checkpoint (see why_no_background_save)
    #: DeepSpeed's engine writes and reads its checkpoint directories on local files only: Lite
    #: refuses an fsspec URL before anything is written (docs/cloud-checkpoints.md).
    checkpoint_urls: ClassVar[bool] = False
    loads_safetensors: ClassVar[bool] = False  # the engine holds the weights its own way

    def __init__(self, stage: int | None = None, offload_optimizer: bool | None = None,
                 offload_parameters: bool | None = None, *, allgather_bucket_size: int | None = None,
                 reduce_bucket_size: int | None = None, overlap_comm: bool | None = None,
                 contiguous_gradients: bool | None = None, pin_memory: bool | None = None,
                 config: dict[str, Any] | str | Path | None = None, logging_level: int = logging.WARNING,
                 timeout: float | timedelta | None = None, process_group_backend: str | None = None) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend)
        options = {"stage": stage, "offload_optimizer": offload_optimizer, "offload_parameters": offload_parameters,
                   "allgather_bucket_size": allgather_bucket_size, "reduce_bucket_size": reduce_bucket_size,
                   "overlap_comm": overlap_comm, "contiguous_gradients": contiguous_gradients, "pin_memory": pin_memory}
        self._config = _user_config(config, {k: v for k, v in options.items() if v is not None})
        self.stage = _config.stage_of(self._config)
        self._logging_level = logging_level
        self._guard = BackwardGuard()
        self._engines: list[Any] = []
        self._micro_batch_size: int | None = None
        #: What `setup_environment` replaced in `os.environ` (None: absent), put back at teardown.
        self._environ_before: dict[str, str | None] = {}

    @property
    def config(self) -> dict[str, Any]:
        """The DeepSpeed config as the user gave it (before precision and batch size are added)."""
        return self._config

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_engines=[], _guard=BackwardGuard())
        return state

    # -- wiring ----------------------------------------------------------------------------------
    def connect(self, accelerator: Any, environment: Any, device_indexes: list[int], num_nodes: int) -> None:
        super().connect(accelerator, environment, device_indexes, num_nodes)
        _use_deepspeed_accelerator(_DS_ACCELERATORS[accelerator.name])
        _config.validate_sections(self._config)
        device_rank(accelerator.name, self.root_device, self.local_rank, self._config)  # refuses now, not in setup
        logging.getLogger("DeepSpeed").setLevel(self._logging_level)

    def check_precision(self, name: str) -> None:
        _config.with_precision(self._config, name)  # refuses a config that contradicts it, now
        if precision_entry(name).dtype == torch.float16:
            _refuse_unsupported_fp16(self.accelerator)

    # -- environment -----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        if self._environment_ready:
            return
        super().setup_environment()
        import deepspeed

        # DeepSpeed reads these for as long as its engines run, not only in `init_distributed`:
        # LOCAL_RANK in `initialize` and `zero.Init`, in ZeRO-3's cross-rank checks during steps
        # and as its CPU accelerator's current device; RANK in its communication's logging. So
        # they stay set until teardown, which puts back what was there before (or their absence).
        self._environ_before = export_environ(RANK=str(self.global_rank), WORLD_SIZE=str(self.world_size),
                                               LOCAL_RANK=str(self.local_rank))
        deepspeed.init_distributed(dist_backend=self.process_group_backend,
                                   dist_init_required=False, timeout=self.timeout, verbose=False)

    def teardown(self, failed: bool = False) -> None:
        try:
            super().teardown(failed)
        finally:
            before, self._environ_before = self._environ_before, {}
            restore_environ(before)

    def module_init_context(self, empty_init: bool | None = None, *, precision: Precision) -> ContextManager[Any]:
        if self.stage == 3:
            return self._zero_init(precision.name)
        return super().module_init_context(empty_init, precision=precision)

    def _zero_init(self, precision_name: str) -> ContextManager[Any]:
        if not self._environment_ready:
            raise MisuseError(
                "ZeRO-3 builds models across the processes, which are not running yet: create the model"
                " inside run() (or after launch())."
            )
        import deepspeed
        # zero.Init replaces `torch.Tensor.__new__`; torch._dynamo, imported lazily by the first
        # optimizer, refuses to load under that patch, so it must be imported before.
        import torch._dynamo  # noqa: F401

        config = _config.with_batch_size(self._full_config(precision_name), 1)
        remote = "cpu" if _config.offloads_parameters(config) else None
        with self._deepspeed_local_rank():  # zero.Init takes its device from LOCAL_RANK, now
            return deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote)

    def _deepspeed_local_rank(self) -> ContextManager[None]:
        """`LOCAL_RANK` naming this process's device while DeepSpeed picks its device from it."""
        assert self.accelerator is not None
        index = device_rank(self.accelerator.name, self.root_device, self.local_rank, self._config)
        return _local_rank_env(index)

    def _full_config(self, precision_name: str) -> dict[str, Any]:
        """The config DeepSpeed runs: the user's, with Lite's defaults and the section of the job's
        precision (named by the hook that builds an engine or `zero.Init`; the strategy holds none)."""
        return _config.with_precision(_config.with_lite_defaults(self._config), precision_name)

    # -- models and optimizers -------------------------------------------------------------------
    def module_to_device(self, module: nn.Module) -> nn.Module:
        # ZeRO-3 places (or offloads) each parameter shard itself.
        return module if self.stage == 3 else super().module_to_device(module)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], *,
                                    precision: Precision) -> tuple[nn.Module, list[Optimizer]]:
        if len(optimizers) > 1:
            raise MisuseError(
                "DeepSpeed steps one optimizer per model: put the parameter groups into one optimizer,"
                " or set up each model with its own optimizer."
            )
        engine = self._initialize(module, optimizers[0] if optimizers else None, precision.name)
        return engine, [DeepSpeedEngineOptimizer(engine, o) for o in optimizers]

    def setup_module(self, module: nn.Module, *, precision: Precision) -> nn.Module:
        if self.stage in (1, 2):
            raise MisuseError(
                f"ZeRO stage {self.stage} shards the optimizer, so it needs one: call setup(model, optimizer),"
                " or use stage 3 for a model without an optimizer (e.g. inference)."
            )
        return self._initialize(module, None, precision.name)

    def full_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """Under stage 3 the partitions are gathered for the copy (DeepSpeed's `GatheredParameters`)."""
        if self.stage != 3:
            return super().full_module_state_dict(module)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return super().full_module_state_dict(module)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise MisuseError(
            "DeepSpeed sets up a model and its optimizer together: call setup(model, optimizer) instead"
            " of setup_module() and setup_optimizers()."
        )

    def _initialize(self, module: nn.Module, optimizer: Optimizer | None, precision_name: str) -> Any:
        import deepspeed

        config = _config.with_batch_size(self._full_config(precision_name), self._micro_batch_size or 1)
        _configure_activation_checkpointing(config)
        with self._deepspeed_local_rank():
            engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config,
                                                   dist_init_required=False)
        self._guard.attach(engine)
        self._engines.append(engine)
        return engine

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        if self._micro_batch_size is None and not _config.has_batch_size(self._config):
            size = _batch_size_of(dataloader)
            if size is not None:
                self._micro_batch_size = size
                for engine in self._engines:
                    engine.set_train_micro_batch_size(size)
        return dataloader

    def engine_of(self, optimizer: Optimizer) -> Any:
        """The DeepSpeed engine that steps `optimizer` (as `setup` returned it)."""
        inner = getattr(optimizer, "optimizer", optimizer)  # Lite's wrapper holds ours
        if isinstance(optimizer, DeepSpeedEngineOptimizer):
            return optimizer.engine
        if isinstance(inner, DeepSpeedEngineOptimizer):
            return inner.engine
        raise MisuseError("This optimizer was not set up with its model by DeepSpeed: pass the one setup(model, optimizer) returned.")

    # -- training step -----------------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, precision: Precision,
                 **kwargs: Any) -> None:
        engine = _engine(module)  # which applies the precision itself (its config's section)
        self._guard.running = True
        try:
            engine.backward(tensor, *args, **kwargs)
        finally:
            self._guard.running = False

    def optimizer_step(self, optimizer: Optimizer, *, precision: Precision, **kwargs: Any) -> Any:
        if kwargs.get("closure") is not None:
            raise MisuseError("DeepSpeed cannot step an optimizer with a closure (e.g. LBFGS): use an optimizer without one.")
        engine = self.engine_of(optimizer)
        try:
            engine.step()
        finally:
            _restore_clipping(engine)
        return None

    def no_backward_sync(self, module: nn.Module) -> ContextManager[Any]:
        return _accumulating(_engine(module))

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True, *,
                            precision: Precision) -> torch.Tensor | None:
        if norm_type != 2.0:
            raise MisuseError(f"DeepSpeed clips by the 2-norm only but norm_type={norm_type}: pass norm_type=2.0.")
        engine = self.engine_of(optimizer)
        sharded = getattr(engine.optimizer, "clip_grad", None) is not None
        if not sharded:  # a plain torch optimizer (stage 0, 32-true): the gradients are whole here
            return torch.nn.utils.clip_grad_norm_(engine.module.parameters(), max_norm,
                                                  error_if_nonfinite=error_if_nonfinite)
        # The gradients are sharded: DeepSpeed clips them, by the global norm, in the next step.
        engine.optimizer.clip_grad = float(max_norm)
        return None

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float, *,
                             precision: Precision) -> None:
        raise MisuseError("DeepSpeed clips gradients by norm only: call clip_gradients(model, optimizer, max_norm=...).")

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, content: dict[str, Any], *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> None:
        """Write a DeepSpeed checkpoint directory at `path` (every rank writes its shards) holding
        the model, its optimizer and the rest of `content`; without a DeepSpeed model in `content`,
        one file as the core writes it."""
        if _checkpoint.find_engine(content) is None:
            _checkpoint.refuse_optimizer_alone(content)
            super().save_checkpoint(path, content, checkpoint_io=checkpoint_io, precision=precision)
            return
        _checkpoint.save(path, content, self, precision=precision)

    def why_no_background_save(self) -> str | None:
        """DeepSpeed writes its engine checkpoint itself (`engine.save_checkpoint`, with collectives
        over the training process group and no copy to host memory first), so it cannot run in
        a thread beside training: `save(blocking=False)` writes in the foreground."""
        return ("DeepSpeed's engine.save_checkpoint writes each rank's shards straight from the live"
                " engine with collectives over the training process group, so it cannot run beside"
                " training; use save(...) (blocking), or DeepSpeed's own asynchronous checkpointing")

    def load_checkpoint(self, path: str, state: dict[str, Any] | None = None, strict: bool = True,
                        weights_only: bool = True, *, checkpoint_io: CheckpointIO,
                        precision: Precision) -> dict[str, Any]:
        """Resume the DeepSpeed model and optimizer in `state` from any checkpoint: a directory
        written by `save_checkpoint` (any ZeRO stage, any number of processes), a one-file or an
        fsdp checkpoint; the other entries are restored as the core restores them."""
        if _checkpoint.find_engine(state or {}) is None:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only,
                                           checkpoint_io=checkpoint_io, precision=precision)
        if _checkpoint.is_deepspeed_directory(path):
            return _checkpoint.load(path, state or {}, strict, self, weights_only, precision=precision)
        content = read_checkpoint(path, checkpoint_io, weights_only)
        return _checkpoint.load_whole(content, state or {}, strict, self, precision=precision)

    @classmethod
    def read_whole_checkpoint(cls, path: str, weights_only: bool = True) -> dict[str, Any]:
        """A DeepSpeed checkpoint directory read in one process as a one-file checkpoint holds it
        (the model as a full fp32 state dict, the optimizer's fp32 state keyed by parameter name),
        so that `ddp`, `single_device`, `fsdp` and the other strategies load it."""
        from lite_deepspeed._portable import read_whole

        return read_whole(path, weights_only)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stage={self.stage})"


def _user_config(config: dict[str, Any] | str | Path | None, options: dict[str, Any]) -> dict[str, Any]:
    if config is not None and options:
        raise ConfigurationError(
            f"DeepSpeedStrategy got both config and {sorted(options)}: put those settings into the config,"
            " or pass keyword options only."
        )
    if config is None:
        options.setdefault("stage", 2)
        return _config.zero_config(**{"offload_optimizer": False, "offload_parameters": False, **options})
    loaded = _config.read_config(config)
    _config.check_keys(loaded)
    return loaded


def _use_deepspeed_accelerator(name: str) -> None:
    """Make DeepSpeed use the device Lite chose (it reads `DS_ACCELERATOR` on first use)."""
    os.environ["DS_ACCELERATOR"] = name
    try:
        from deepspeed.accelerator import get_accelerator, set_accelerator
    except ImportError as err:
        raise ConfigurationError(
            "strategy='deepspeed' needs the deepspeed package, which is not importable"
            f" ({type(err).__name__}: {err}): install torch first, then run"
            " `DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`."
        ) from err
    if get_accelerator().device_name() != name:
        set_accelerator(_deepspeed_accelerator(name))


def _deepspeed_accelerator(name: str) -> Any:
    if name == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        return CPU_Accelerator()
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    return CUDA_Accelerator()


def device_rank(accelerator: str, device: torch.device, local_rank: int, config: dict[str, Any]) -> int | None:
    """The GPU index DeepSpeed must take for this process when it is not `local_rank` (e.g.
    `devices=[2, 3]`), or None when DeepSpeed's own choice (`LOCAL_RANK`) is already right.

    DeepSpeed places the engine and ZeRO-3 parameters on the GPU numbered `LOCAL_RANK`, and with
    `checkpoint.use_node_local_storage` it also takes that number as the rank that writes the
    node's checkpoint files, so a device list unlike `[0, 1, ...]` cannot serve both.
    """
    if accelerator != "cuda" or device.index is None or device.index == local_rank:
        return None
    if (config.get("checkpoint") or {}).get("use_node_local_storage"):
        raise ConfigurationError(
            f"DeepSpeed's checkpoint.use_node_local_storage takes the GPU number as the local rank, but local"
            f" rank {local_rank} runs on GPU {device.index}: pass devices=N (GPUs 0..N-1, e.g. with"
            " CUDA_VISIBLE_DEVICES) or turn use_node_local_storage off."
        )
    return device.index


@contextmanager
def _local_rank_env(index: int | None) -> Iterator[None]:
    if index is None:
        yield
        return
    before = export_environ(LOCAL_RANK=str(index))
    try:
        yield
    finally:
        restore_environ(before)


def _configure_activation_checkpointing(config: dict[str, Any]) -> None:
    """Apply the config's `activation_checkpointing` section to `deepspeed.checkpointing`, which
    DeepSpeed's engine does not do by itself."""
    if config.get("activation_checkpointing") is None:
        return
    import deepspeed

    deepspeed.checkpointing.configure(mpu_=None, deepspeed_config=config)


def _engine(module: nn.Module | None) -> Any:
    from deepspeed import DeepSpeedEngine

    if not isinstance(module, DeepSpeedEngine):
        raise MisuseError("This model was not set up by the DeepSpeed strategy: pass the model that setup() returned.")
    return module


@contextmanager
def _accumulating(engine: Any) -> Iterator[None]:
    """Backward passes inside accumulate gradients without DeepSpeed's reduction at the boundary;
    the next backward outside is the boundary again."""
    engine.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        engine.set_gradient_accumulation_boundary(None)


def _restore_clipping(engine: Any) -> None:
    if getattr(engine.optimizer, "clip_grad", None) is not None:
        engine.optimizer.clip_grad = float(engine.gradient_clipping())


def _batch_size_of(dataloader: Any) -> int | None:
    size = getattr(dataloader, "batch_size", None)
    if size is None:
        size = getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _refuse_unsupported_fp16(accelerator: Any) -> None:
    """DeepSpeed refuses fp16 deep inside `deepspeed.initialize` on a device without it (on a CPU:
    no oneDNN float16, i.e. no AVX512-FP16 or AMX-FP16); refuse at construction instead."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        raise ConfigurationError(
            f"precision='16-mixed' needs float16 support that DeepSpeed does not find on accelerator="
            f"{accelerator.name!r} here: use precision='bf16-mixed' or '32-true'."
        )
