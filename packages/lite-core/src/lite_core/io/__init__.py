"""Checkpoint IO plugins (kept for imports written against lite-core 0.1; they live in
`lite_core.checkpoint`)."""

from lite_core.checkpoint import CheckpointIO, TorchCheckpointIO

__all__ = ["CheckpointIO", "TorchCheckpointIO"]
