"""Loggers: where `LightningLite.log` and `log_dict` send metrics (from global rank 0 only).

`WandbLogger`, `MLflowLogger` and `TrackioLogger` import their tracker's client only when rank 0 first logs."""

from lite_core.loggers.csv_logger import CSVLogger
from lite_core.loggers.logger import Logger
from lite_core.loggers.mlflow_logger import MLflowLogger
from lite_core.loggers.tensorboard_logger import TensorBoardLogger
from lite_core.loggers.trackio_logger import TrackioLogger
from lite_core.loggers.wandb_logger import WandbLogger

__all__ = ["CSVLogger", "Logger", "MLflowLogger", "TensorBoardLogger", "TrackioLogger", "WandbLogger"]
