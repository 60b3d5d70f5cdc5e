"""Construction-time behaviour of the sharded strategies, `empty_init` under the strategies that
keep whole models, and optimizer state keyed by parameter name (the sharded checkpoint format).

The multi-process behaviour is proven in `tests/integration/sharded/`.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.checkpoint._state import is_keyed_by_name, names_to_positions, positions_to_names
from lite_core.errors import BackendNotInstalledError, CheckpointError, ConfigurationError
from lite_core.strategies import FSDPStrategy


def _one_sentence(message: str) -> None:
    assert message.endswith(".") and ". " not in message, message


# -- fsdp configuration ---------------------------------------------------------------------------
def test_fsdp_refuses_float16_mixed_precision_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="precision='16-mixed' is not supported by strategy='fsdp'") as info:
        LightningLite(accelerator="cpu", strategy="fsdp", devices=2, precision="16-mixed")
    _one_sentence(str(info.value))
    assert "bf16-mixed" in str(info.value)


def test_fsdp_refuses_an_unknown_state_dict_type() -> None:
    with pytest.raises(ConfigurationError, match="state_dict_type='everything'") as info:
        FSDPStrategy(state_dict_type="everything")
    _one_sentence(str(info.value))


def test_fsdp_bf16_mixed_autocasts_over_float32_parameters_unless_given_a_policy() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    lite = LightningLite(accelerator="cpu", strategy="fsdp", devices=2, precision="bf16-mixed")
    assert lite._plan.precision.changes_forward  # autocast, as under ddp
    assert lite.strategy._mp_policy() == MixedPrecisionPolicy()  # fully_shard casts nothing
    with lite.autocast():
        assert torch.is_autocast_enabled("cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    lite = LightningLite(accelerator="cpu", strategy=FSDPStrategy(mixed_precision=policy), devices=2,
                         precision="bf16-mixed")
    assert lite.strategy._mp_policy() is policy


def test_fsdp_refuses_a_mixed_precision_that_is_not_a_policy() -> None:
    with pytest.raises(ConfigurationError, match="mixed_precision='bf16' is not a policy") as info:
        FSDPStrategy(mixed_precision="bf16")
    _one_sentence(str(info.value))


def test_fsdp_empty_init_builds_on_the_meta_device() -> None:
    lite = LightningLite(accelerator="cpu", strategy="fsdp", devices=2)
    with lite.init_module(empty_init=True):
        model = nn.Linear(1000, 1000)
    assert model.weight.is_meta and model.bias.is_meta


class _Scale(nn.Module):
    """A module with a parameter and no reset_parameters(), as a transformers norm layer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


def test_a_meta_module_is_reinitialised_by_the_roots_init_weights_where_it_lacks_reset_parameters() -> None:
    from lite_core.errors import MisuseError
    from lite_core.strategies._fsdp_init import _initialiser, check_reinitialisable

    plain = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(MisuseError, match=r"The module '1' \(_Scale\) holds parameters but has no reset_parameters\(\)"):
        check_reinitialisable(plain)

    class WithInitWeights(nn.Sequential):  # the transformers convention: the root initialises each module
        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, _Scale):
                module.weight.data.fill_(2.0)

    model = WithInitWeights(nn.Linear(4, 4), _Scale())
    check_reinitialisable(model)
    _initialiser(model, model[1])()
    assert torch.equal(model[1].weight, torch.full((4,), 2.0))
    assert _initialiser(model, model[0]) == model[0].reset_parameters  # its own reset_parameters() first


# -- ddp_sharded configuration --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ddp_sharded", "ddp_sharded_spawn"])
def test_ddp_sharded_without_fairscale_names_the_install_line(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fairscale", None)  # how Python marks a package unimportable
    with pytest.raises(BackendNotInstalledError, match=r"pip install 'fairscale>=0\.4\.13'") as info:
        LightningLite(accelerator="cpu", strategy=name, devices=2)
    _one_sentence(str(info.value))
    assert f"strategy='{name}' needs fairscale" in str(info.value)


@pytest.mark.fairscale  # meaningful where fairscale is installed
def test_core_and_ddp_never_import_fairscale() -> None:
    code = (
        "import sys\n"
        "from lite_core import LightningLite\n"
        "LightningLite(accelerator='cpu', strategy='ddp', devices=2)\n"
        "LightningLite(accelerator='cpu', strategy='fsdp', devices=2)\n"
        "assert 'fairscale' not in sys.modules, 'fairscale was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.fairscale
def test_ddp_sharded_refuses_bucketed_reduction() -> None:
    pytest.importorskip("fairscale", reason="fairscale is not installed: run `hatch run test-fairscale:all`")
    from lite_core.strategies import DDPShardedStrategy

    with pytest.raises(ConfigurationError, match="reduce_buffer_size") as info:
        DDPShardedStrategy(reduce_buffer_size=2**23)
    _one_sentence(str(info.value))


# -- empty_init under strategies that keep whole models --------------------------------------------
def test_empty_init_under_single_device_skips_initialisation() -> None:
    lite = LightningLite(accelerator="cpu")
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with lite.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    assert torch.equal(torch.get_rng_state(), before), "initialisation drew random numbers"
    assert not any(p.is_meta for p in model.parameters())
    trained = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    model.load_state_dict(trained.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained.parameters()))
    # Outside the context, initialisation works again.
    torch.manual_seed(3)
    first = nn.Linear(4, 4).weight.clone()
    torch.manual_seed(3)
    assert torch.equal(nn.Linear(4, 4).weight, first) and first.abs().sum() > 0


class _CausalBlock(nn.Module):
    """A block whose `__init__` writes buffers: they are state, not initialisation to skip."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(n, n)
        self.norm = nn.BatchNorm1d(n)
        self.register_buffer("mask", torch.ones(n, n).tril())
        self.register_buffer("scale", torch.empty(n).fill_(3.0), persistent=False)


def test_empty_init_under_single_device_keeps_the_buffers_init_wrote() -> None:
    lite = LightningLite(accelerator="cpu")
    with lite.init_module(empty_init=True):
        block = _CausalBlock()
    assert torch.equal(block.mask, torch.ones(6, 6).tril())
    assert torch.equal(block.scale, torch.full((6,), 3.0))
    assert torch.equal(block.norm.running_var, torch.ones(6))
    assert torch.equal(block.norm.running_mean, torch.zeros(6))


def test_empty_init_false_initialises_normally() -> None:
    lite = LightningLite(accelerator="cpu")
    torch.manual_seed(5)
    with lite.init_module(empty_init=False):
        built = nn.Linear(8, 8)
    torch.manual_seed(5)
    assert torch.equal(built.weight, nn.Linear(8, 8).weight)


# -- optimizer state keyed by parameter name ------------------------------------------------------
def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    optimizer = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}])
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_optimizer_state_converts_between_positions_and_names() -> None:
    model, optimizer = _trained()
    by_position = optimizer.state_dict()
    by_name = positions_to_names(by_position, optimizer, model)
    assert is_keyed_by_name(by_name) and not is_keyed_by_name(by_position)
    assert by_name["param_groups"][1]["params"] == ["1.weight", "1.bias"]
    assert by_name["param_groups"][1]["lr"] == 0.5
    assert torch.equal(by_name["state"]["1.bias"]["exp_avg"], by_position["state"][3]["exp_avg"])
    back = names_to_positions(by_name, optimizer, model)
    assert back["param_groups"] == by_position["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], by_position["state"][i]["exp_avg"]) for i in range(4))


def test_load_restores_name_keyed_optimizer_state_under_single_device(tmp_path: Path) -> None:
    model, optimizer = _trained()
    torch.save({"model": model.state_dict(), "optimizer": positions_to_names(optimizer.state_dict(), optimizer, model)},
               tmp_path / "ckpt.pt")
    lite = LightningLite(accelerator="cpu")
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    fresh_opt = torch.optim.Adam([{"params": fresh[0].parameters()}, {"params": fresh[1].parameters(), "lr": 0.5}])
    fresh, fresh_opt = lite.setup(fresh, fresh_opt)
    lite.load(tmp_path / "ckpt.pt", {"model": fresh, "optimizer": fresh_opt})
    expected = optimizer.state_dict()
    restored = fresh_opt.state_dict()
    assert restored["param_groups"] == expected["param_groups"]
    for index in range(4):
        assert torch.equal(restored["state"][index]["exp_avg_sq"], expected["state"][index]["exp_avg_sq"])


def test_name_keyed_optimizer_state_needs_its_model_in_state(tmp_path: Path) -> None:
    model, optimizer = _trained()
    torch.save({"optimizer": positions_to_names(optimizer.state_dict(), optimizer, model)}, tmp_path / "ckpt.pt")
    lite = LightningLite(accelerator="cpu")
    with pytest.raises(CheckpointError, match="pass the model in the same `state`") as info:
        lite.load(tmp_path / "ckpt.pt", {"optimizer": optimizer})
    _one_sentence(str(info.value))


# -- sharded checkpoint directories, read in one process -----------------------------------------
def _sharded_checkpoint(folder: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A checkpoint directory in the format `fsdp` writes, made here without a process group."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _trained()
    tensors = {"model": model.state_dict(), "optimizer": positions_to_names(optimizer.state_dict(), optimizer, model)}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, checkpoint_id=folder, no_dist=True)
    torch.save({"step": 4}, folder / "lite_extra.pt")
    return model, optimizer


def test_consolidate_turns_a_sharded_directory_into_one_file(tmp_path: Path) -> None:
    from lite_core.checkpoint import consolidate, is_sharded

    model, _ = _sharded_checkpoint(tmp_path / "ckpt")
    assert is_sharded(tmp_path / "ckpt") and not is_sharded(tmp_path)
    consolidate(tmp_path / "ckpt", tmp_path / "one.pt")
    content = torch.load(tmp_path / "one.pt", weights_only=True)
    assert content["step"] == 4
    assert all(torch.equal(content["model"][k], v) for k, v in model.state_dict().items())
    assert set(content["optimizer"]["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_single_device_loads_a_sharded_directory(tmp_path: Path) -> None:
    model, optimizer = _sharded_checkpoint(tmp_path / "ckpt")
    lite = LightningLite(accelerator="cpu")
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    fresh_opt = torch.optim.Adam([{"params": fresh[0].parameters()}, {"params": fresh[1].parameters(), "lr": 0.5}])
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    lite.load(tmp_path / "ckpt", state)
    assert state["step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    assert torch.equal(fresh_opt.state_dict()["state"][2]["exp_avg"], optimizer.state_dict()["state"][2]["exp_avg"])


def test_consolidate_refuses_what_is_not_a_complete_sharded_checkpoint(tmp_path: Path) -> None:
    from lite_core.checkpoint import consolidate

    with pytest.raises(CheckpointError, match="is not a sharded checkpoint directory") as info:
        consolidate(tmp_path, tmp_path / "one.pt")
    _one_sentence(str(info.value))
    _sharded_checkpoint(tmp_path / "ckpt")
    for shard in (tmp_path / "ckpt").glob("*.distcp"):
        shard.unlink()
    with pytest.raises(CheckpointError, match="is incomplete or damaged") as info:
        consolidate(tmp_path / "ckpt", tmp_path / "one.pt")
    _one_sentence(str(info.value))
    assert not (tmp_path / "one.pt").exists()


# -- core hooks -----------------------------------------------------------------------------------
def test_wrapped_model_load_state_dict_goes_through_the_strategy() -> None:
    from lite_core.strategies import SingleDeviceStrategy

    calls = []

    class Recording(SingleDeviceStrategy):
        routes_load_state_dict = True

        def load_module_state_dict(self, module, state_dict, strict=True, assign=False):
            calls.append((module, strict))
            return super().load_module_state_dict(module, state_dict, strict=strict, assign=assign)

    lite = LightningLite(accelerator="cpu", strategy=Recording())
    user_model = nn.Linear(2, 2)
    model = lite.setup(user_model)
    source = nn.Linear(2, 2)
    model.load_state_dict(source.state_dict(), strict=False)
    assert calls == [(user_model, False)]
    assert torch.equal(user_model.weight, source.weight)
