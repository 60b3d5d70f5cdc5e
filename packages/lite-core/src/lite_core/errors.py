"""Errors raised by Lite. Each message is one sentence that names what was wrong and the fix."""

from __future__ import annotations


class LiteError(Exception):
    """Base class of every error Lite raises on purpose."""


class ConfigurationError(LiteError, ValueError):
    """The arguments given to `LightningLite` (or a plugin) cannot work together."""


class UnknownNameError(ConfigurationError):
    """A name for an accelerator or strategy that no installed or known backend provides."""


class BackendNotInstalledError(ConfigurationError, ImportError):
    """A name that a known backend provides, but that backend is not installed."""


class IncompatibleBackendError(ConfigurationError, ImportError):
    """An installed backend whose `lite-core` requirement excludes the installed core."""


class BackendImportError(ConfigurationError, ImportError):
    """An installed backend that fails to import."""


class MisuseError(LiteError, RuntimeError):
    """A Lite method called in a way or at a moment where it cannot work."""


class CollectiveTimeoutError(LiteError, RuntimeError):
    """A collective that some rank did not reach within the strategy's timeout; names that rank."""


class CheckpointError(LiteError, RuntimeError):
    """A checkpoint that is missing, truncated, foreign or refused by safe loading."""


class MissingDependencyError(ConfigurationError, ImportError):
    """An optional feature (e.g. TensorBoard logging) whose package is not installed."""
