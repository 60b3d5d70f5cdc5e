"""TPUs and other XLA devices for Lite: `LightningLite(accelerator="tpu", devices=8)`.

Importing this package does not import torch-xla; that happens when a strategy first needs it.
"""

from lite_xla.__about__ import __version__

__all__ = ["__version__"]
