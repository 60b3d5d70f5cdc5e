"""The TPU peak table behind MFU: per-chip bf16 figures by generation, read from
`TPU_ACCELERATOR_TYPE`; no figure off TPU or for float32, which TPUs do not publish."""

from __future__ import annotations

import pytest

from lite_xla._peaks import dense_peak_flops


@pytest.mark.parametrize(("accelerator_type", "tflops"), [
    ("v4-8", 275.0), ("v5litepod-8", 197.0), ("v5p-128", 459.0), ("v6e-8", 918.0), ("v3-8", 123.0),
])
def test_bf16_peaks_per_chip(accelerator_type: str, tflops: float) -> None:
    assert dense_peak_flops(accelerator_type, "bf16") == pytest.approx(tflops * 1e12)


def test_no_peak_off_tpu_or_for_float32() -> None:
    assert dense_peak_flops(None, "bf16") is None
    assert dense_peak_flops("v4-8", "fp32") is None
    assert dense_peak_flops("unknown-8", "bf16") is None
