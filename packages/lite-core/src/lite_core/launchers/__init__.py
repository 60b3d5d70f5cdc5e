"""Launchers: what starts the processes of a job."""

from lite_core.launchers.launcher import Launcher

__all__ = ["Launcher"]
