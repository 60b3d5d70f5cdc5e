"""Strategies: how work is spread over processes."""

from lite_core.strategies.strategy import Strategy

__all__ = ["Strategy"]
