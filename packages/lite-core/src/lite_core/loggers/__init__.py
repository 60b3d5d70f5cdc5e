"""Loggers: where `LightningLite.log` and `log_dict` send metrics (from global rank 0 only)."""

from lite_core.loggers.csv_logger import CSVLogger
from lite_core.loggers.logger import Logger
from lite_core.loggers.tensorboard_logger import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
