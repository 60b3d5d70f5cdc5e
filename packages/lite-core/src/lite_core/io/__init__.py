"""Checkpoint IO plugins."""

from lite_core.io.checkpoint_io import CheckpointIO, TorchCheckpointIO

__all__ = ["CheckpointIO", "TorchCheckpointIO"]
