"""A new precision is one row of the precision table: strategies and accelerators declare what they
carry by property (families, dtypes, hardware), so every one whose declaration fits runs it, and
the others refuse it in their one sentence, with nothing else to change."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lite_core import LightningLite
from lite_core.errors import ConfigurationError
from lite_core.monitor import _matmul_dtype
from lite_core.plugins import PrecisionEntry, PrecisionSupport, register_precision
from lite_core.precision.names import unregister_precision
from lite_core.precision.precision import TruePrecision
from lite_core.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy


def _half_weights(name: str, device_type: str) -> TruePrecision:
    return TruePrecision(name, torch.float16)


@pytest.fixture
def toy_rows() -> Iterator[None]:
    """Two rows a newcomer adds: float16 weights, and a precision that needs hardware the CPU lacks."""
    register_precision(PrecisionEntry("toy-true", "true", torch.float16, "fp16", _half_weights))
    register_precision(PrecisionEntry("toy-units", "true", torch.float32, "fp32", _half_weights,
                                      needs=frozenset({"toy-units"})))
    yield
    unregister_precision("toy-true")
    unregister_precision("toy-units")


def test_a_new_row_runs_where_the_declarations_fit(toy_rows: None) -> None:
    lite = LightningLite(accelerator="cpu", devices=1, precision="toy-true")
    model = lite.setup_module(nn.Linear(2, 2))
    assert next(model.parameters()).dtype == torch.float16  # built as its row says
    assert _matmul_dtype("toy-true") == "fp16"  # the throughput monitor's peak reads the row too
    # float16 weights: the strategies that carry any `true` dtype take it, read from the table now
    assert "toy-true" in DDPStrategy.supported_precisions and "toy-true" in FSDPStrategy.supported_precisions


def test_a_new_row_is_refused_where_a_declaration_does_not_fit(toy_rows: None) -> None:
    # model_parallel carries float32 and bfloat16 weights only
    with pytest.raises(ConfigurationError, match=r"^precision='toy-true' is not supported by strategy='model_parallel'"):
        LightningLite(accelerator="cpu", strategy=ModelParallelStrategy(), devices=1, precision="toy-true")
    # the CPU has no 'toy-units': the accelerator refuses the row that needs them
    with pytest.raises(ConfigurationError, match=r"^precision='toy-units' is not supported by strategy='single_device' on accelerator='cpu'"):
        LightningLite(accelerator="cpu", devices=1, precision="toy-units")


def test_a_declaration_reads_families_dtypes_and_hardware() -> None:
    support = PrecisionSupport(families=frozenset({"true", "mixed"}), true_dtypes=frozenset({torch.float32}),
                               mixed_dtypes=frozenset({torch.bfloat16}), hardware=frozenset())
    assert support.names() == {"32-true", "bf16-mixed"}
    assert PrecisionSupport(families=frozenset({"fp8"})).names() == {"fp8-tensorwise", "fp8-rowwise"}
    assert PrecisionSupport(families=frozenset({"fp8"}), hardware=frozenset()).names() == set()


def test_a_row_needs_a_new_name_and_a_known_family() -> None:
    with pytest.raises(ConfigurationError, match=r"^precision 'bf16-true' is in the table already"):
        register_precision(PrecisionEntry("bf16-true", "true", torch.bfloat16, "bf16", _half_weights))
    with pytest.raises(ConfigurationError, match=r"^PrecisionEntry\(family='int4'\) is not a family"):
        register_precision(PrecisionEntry("toy-int4", "int4", None, None, _half_weights))  # type: ignore[arg-type]
