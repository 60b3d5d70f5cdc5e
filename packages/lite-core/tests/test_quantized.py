"""The quantized precision (bitsandbytes, QLoRA) on one process: the layers it replaces, its names
and refusals. Training against bitsandbytes by hand, under `single_device` and `ddp`, with
checkpoints, is in tests/integration/test_qlora.py."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lite_core import LightningLite, QuantizedPrecision, TorchaoNF4Precision
from lite_core.errors import ConfigurationError, MisuseError, MissingDependencyError
from lite_core.precision import Precision

bnb = pytest.importorskip("bitsandbytes", reason="needs lite-core[bnb] (bitsandbytes), which the test environment"
                                                 " installs")


class Adapter(nn.Module):
    """A LoRA-like layer: a frozen base Linear beside trainable `lora_A`/`lora_B` (peft's names)."""

    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(32, 32)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(32, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, 32, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.attn = Adapter()
        self.trained = nn.Linear(32, 32)  # the user trains it: not quantized
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trained(self.attn(torch.relu(self.up(x)))))


def _frozen(net: Net) -> Net:
    """`net` with its base frozen: only the adapters and `trained` train."""
    for name, parameter in net.named_parameters():
        parameter.requires_grad = "lora_" in name or name.startswith("trained")
    return net


def frozen_net() -> Net:
    torch.manual_seed(0)
    return _frozen(Net())


def quantized_names(model: nn.Module, kind: type) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, kind)}


@pytest.mark.parametrize(("mode", "kind"), [("nf4", "Linear4bit"), ("nf4-dq", "Linear4bit"), ("fp4", "Linear4bit"),
                                            ("fp4-dq", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_the_frozen_base_is_quantized_and_the_head_adapters_and_trained_layers_are_not(mode: str, kind: str) -> None:
    lite = LightningLite(accelerator="cpu", precision=mode)
    assert isinstance(lite._plan.precision, QuantizedPrecision) and lite._plan.precision.name == mode
    model = lite.setup(frozen_net())
    assert quantized_names(model, getattr(bnb.nn, kind)) == {"up", "attn.base_layer"}
    for name in ("attn.lora_A.default", "attn.lora_B.default", "trained", "head"):
        assert type(model.get_submodule(name)) is nn.Linear, name
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(name for name, p in frozen_net().named_parameters() if p.requires_grad)


def test_a_4bit_layer_computes_in_the_chosen_dtype_on_the_quantized_weight() -> None:
    model = LightningLite(accelerator="cpu", precision=QuantizedPrecision("nf4", compute_dtype=torch.bfloat16)).setup(
        frozen_net())
    layer = model.get_submodule("up")
    assert layer.compute_dtype == torch.bfloat16 and layer.weight.dtype == torch.uint8
    x = torch.randn(3, 16)
    weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(torch.bfloat16)
    expected = nn.functional.linear(x.to(torch.bfloat16), weight, layer.bias.to(torch.bfloat16)).float()
    assert torch.equal(layer(x), expected) and layer(x).dtype == torch.float32  # the input's dtype back
    default = LightningLite(accelerator="cpu", precision="nf4").setup(frozen_net()).get_submodule("up")
    assert default.compute_dtype == torch.float32  # the weight's dtype


@pytest.mark.parametrize("mode", ["nf4", "fp4-dq"])
def test_full_precision_weights_loaded_into_a_set_up_model_are_quantized_as_they_arrive(mode: str) -> None:
    # The base's own checkpoint (full precision, [out, in]) loads into the set-up 4-bit model: each
    # weight is quantized as the one set up from those weights would be, bit for bit.
    torch.manual_seed(5)
    other = Net()  # other weights than frozen_net()'s
    lite = LightningLite(accelerator="cpu", precision=mode)
    model = lite.setup(frozen_net())
    model.load_state_dict(other.state_dict())
    reference = lite.setup(_frozen(other))
    for name in ("up", "attn.base_layer"):
        loaded, expected = model.get_submodule(name).weight, reference.get_submodule(name).weight
        assert loaded.dtype == torch.uint8 and torch.equal(loaded.data, expected.data), name
        assert torch.equal(loaded.quant_state.absmax, expected.quant_state.absmax), name
    x = torch.randn(3, 16)
    assert torch.equal(model(x), reference(x))


class Probe(nn.Module):
    """A base as a user writes it: Linear layers, a buffer computed in `__init__`, an embedding tied
    to the head; it records whether its layers held memory while it was built."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 8, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie them
        self.register_buffer("scale", torch.arange(16.0))
        self.held_while_built = [not layer.weight.is_meta for block in self.blocks for layer in block[::2]]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("mode", ["nf4", "fp4-dq"])
def test_under_empty_init_the_base_is_built_4_bit_and_never_whole_in_full_precision(mode: str) -> None:
    lite = LightningLite(accelerator="cpu", precision=mode)
    with lite.init_module(empty_init=True):
        model = Probe()
    assert model.held_while_built == [False] * 4  # no Linear held its full-precision weight
    layers = {f"blocks.{b}.{i}" for b in (0, 1) for i in (0, 2)}
    assert quantized_names(model, bnb.nn.Linear4bit) == layers
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight  # the tie kept
    assert torch.equal(model.scale, torch.arange(16.0))  # buffers keep what __init__ computed
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    torch.manual_seed(3)
    pretrained = Probe()  # the full-precision weights a user downloads
    model.load_state_dict(pretrained.state_dict())  # each layer quantized as it arrives
    reference = _quantized_by_setup(mode, pretrained)
    tokens = torch.tensor([[1, 5, 2]])
    assert torch.equal(lite.setup(model)(tokens), reference(tokens))


def _quantized_by_setup(mode: str, model: nn.Module) -> nn.Module:
    """`model` with its Linears but the head made 4-bit at setup (the filter: everything frozen)."""
    for parameter in model.parameters():
        parameter.requires_grad = False
    return LightningLite(accelerator="cpu", precision=mode).setup(model)


def test_under_empty_init_int8_layers_are_replaced_at_setup_and_a_lone_linear_is_refused() -> None:
    with LightningLite(accelerator="cpu", precision="int8").init_module(empty_init=True):
        model = Probe()
    assert model.held_while_built == [True] * 4 and not quantized_names(model, bnb.nn.Linear8bitLt)
    everything = QuantizedPrecision("nf4", module_filter_fn=lambda module, name: True)
    with pytest.raises(MisuseError, match=r"^init_module\(empty_init=True\) cannot make a model that is one nn.Linear"):
        with LightningLite(accelerator="cpu", precision=everything).init_module(empty_init=True):
            nn.Linear(4, 4)


def test_the_user_filter_chooses_the_layers() -> None:
    chosen = QuantizedPrecision("nf4", module_filter_fn=lambda module, name: name in ("head", "trained"))
    model = LightningLite(accelerator="cpu", precision=chosen).setup(frozen_net())
    assert quantized_names(model, bnb.nn.Linear4bit) == {"head", "trained"}


def _refused_by_name_and_as_an_object(strategy: str, name: str, precision: Callable[[], Precision],
                                      reason: str) -> None:
    """`precision=name` under `strategy` on two CPU processes is refused in one sentence: not supported,
    the supported names, then `reason` (a pattern); and so is the object `precision()` makes (the
    object is checked by its name too)."""
    message = (rf"^precision='{name}' is not supported by strategy='{strategy}' on accelerator='cpu': choose one of"
               rf" \[[^]]*\]; {reason}")
    with pytest.raises(ConfigurationError, match=message):
        LightningLite(accelerator="cpu", strategy=strategy, devices=2, precision=name)
    with pytest.raises(ConfigurationError, match=message):
        LightningLite(accelerator="cpu", strategy=strategy, devices=2, precision=precision())


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_a_strategy_that_shards_parameters_refuses_it_in_one_sentence(strategy: str) -> None:
    _refused_by_name_and_as_an_object(
        strategy, "nf4-dq", lambda: QuantizedPrecision("nf4-dq"),
        r"'nf4-dq' keeps whole quantized weights on each process, which a strategy that shards or copies parameters"
        r" cannot carry: choose strategy='ddp' or 'single_device', or precision='nf4-torchao' \(torchao's NF4, which"
        r" fsdp and model_parallel shard\)\.$")


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_torchaos_nf4_is_refused_where_ddp_broadcasts_the_parameters(strategy: str) -> None:
    _refused_by_name_and_as_an_object(
        strategy, "nf4-torchao", TorchaoNF4Precision,
        r"'nf4-torchao' is torchao's NF4 for the strategies that shard parameters with FSDP2 \(DDP's broadcast of the"
        r" parameters corrupts its statistics\): choose strategy='fsdp', 'model_parallel' or 'single_device', or"
        r" precision='nf4' \(bitsandbytes\) under ddp\.$")


def test_a_wrong_mode_is_refused_and_a_misspelt_name_guessed() -> None:
    with pytest.raises(ConfigurationError, match=r"^QuantizedPrecision\(mode='nf5'\) is not a mode: pass one of"
                                                 r" \['fp4', 'fp4-dq', 'int8', 'nf4', 'nf4-dq'\]\.$"):
        QuantizedPrecision("nf5")
    with pytest.raises(ConfigurationError, match=r"^precision='nf-4' is not supported: did you mean 'nf4'\?"):
        LightningLite(accelerator="cpu", precision="nf-4")


def test_without_bitsandbytes_the_install_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    message = (r"^Quantized precision needs the bitsandbytes package, which is not installed: run"
               r" `pip install ('bitsandbytes>=0\.50'|'\./packages/lite-core\[bnb\]')`\.$")
    with pytest.raises(MissingDependencyError, match=message):
        QuantizedPrecision("nf4")
    with pytest.raises(MissingDependencyError, match=message):
        LightningLite(accelerator="cpu", precision="nf4")


def test_torchaos_nf4_refuses_a_base_built_on_the_meta_device_in_one_sentence() -> None:
    # FSDP's init_module(empty_init=True) builds on the meta device: nothing to quantize at setup.
    with torch.device("meta"):
        model = _frozen(Net())
    with pytest.raises(MisuseError, match=r"^precision='nf4-torchao' quantizes the base's weights at setup, and this"
                                          r" model's are on the meta device .*: build the model with empty_init=False"
                                          r" and load its weights before setup\.$"):
        TorchaoNF4Precision().convert_module(model)
