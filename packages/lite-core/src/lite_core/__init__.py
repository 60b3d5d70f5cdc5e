"""Lite: keep your PyTorch training loop and scale it by changing constructor arguments.

Public names are re-exported here and imported lazily, so `import lite_core` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lite_core.__about__ import __version__

if TYPE_CHECKING:
    from lite_core.seed import seed_everything
    from lite_core.lite import LightningLite
    from lite_core.loggers import CSVLogger, Logger, MLflowLogger, TensorBoardLogger, TrackioLogger, WandbLogger
    from lite_core.monitor import ThroughputMonitor, measure_flops
    from lite_core.parallel import MeshLayout
    from lite_core.precision.fp8 import Float8Precision
    from lite_core.progress import progress_bar
    from lite_core.precision.nf4 import TorchaoNF4Precision
    from lite_core.precision.quantized import QuantizedPrecision

__all__ = ["CSVLogger", "Float8Precision", "LightningLite", "Logger", "MLflowLogger", "MeshLayout",
           "QuantizedPrecision", "TensorBoardLogger", "ThroughputMonitor", "TorchaoNF4Precision", "TrackioLogger",
           "WandbLogger", "__version__",
           "measure_flops", "progress_bar", "seed_everything"]

_LAZY = {
    "LightningLite": "lite_core.lite",
    "seed_everything": "lite_core.seed",
    "CSVLogger": "lite_core.loggers",
    "Logger": "lite_core.loggers",
    "TensorBoardLogger": "lite_core.loggers",
    "MLflowLogger": "lite_core.loggers",
    "TrackioLogger": "lite_core.loggers",
    "WandbLogger": "lite_core.loggers",
    "progress_bar": "lite_core.progress",
    "ThroughputMonitor": "lite_core.monitor",
    "measure_flops": "lite_core.monitor",
    "Float8Precision": "lite_core.precision.fp8",
    "MeshLayout": "lite_core.parallel",
    "QuantizedPrecision": "lite_core.precision.quantized",
    "TorchaoNF4Precision": "lite_core.precision.nf4",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lite_core' has no attribute {name!r}")
