"""flair's metric records forwarded to Lightning's loggers (``CSVLogger``, ``TensorBoardLogger``, any
``lightning.fabric.loggers.Logger``), written by global rank 0 only."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterable
from typing import Any

import torch
from flair.trainers.plugins import MetricRecord, TrainerPlugin
from lightning.fabric.loggers import Logger

from flair_fabric.plugins.rank_zero import GlobalZeroPlugin


def _scalars(record: MetricRecord) -> dict[str, float]:
    """The record as ``{name: number}``; a list of values (one learning rate per parameter group) becomes
    ``name/0``, ``name/1``, ...; anything that is not a number is left out."""
    name, value = str(record.name), record.value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {name: float(value)}
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return {name: float(value)}  # type: ignore[arg-type]
    if isinstance(value, (list, tuple)) and all(isinstance(item, numbers.Number) for item in value):
        return {name: float(value[0])} if len(value) == 1 else {f"{name}/{i}": float(v) for i, v in enumerate(value)}
    return {}


def _hyperparameter(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


class LightningLoggerPlugin(GlobalZeroPlugin):
    """Send every numeric flair metric record (train loss, learning rate, dev/test scores and losses, ...) to
    Lightning loggers, with the record's step (epoch or batch count), on global rank 0 only.

    ``trainer.train(..., plugins=[LightningLoggerPlugin(CSVLogger("logs"))])``. The training parameters are logged
    as hyperparameters at set-up; the loggers are finalized when training ends.
    """

    def __init__(self, loggers: Logger | Iterable[Logger]) -> None:
        super().__init__()
        self.loggers = [loggers] if isinstance(loggers, Logger) else list(loggers)
        if not self.loggers or not all(isinstance(logger, Logger) for logger in self.loggers):
            raise TypeError(
                "LightningLoggerPlugin(loggers=...) takes a lightning.fabric.loggers.Logger (e.g. CSVLogger(...),"
                " TensorBoardLogger(...)) or a list of them."
            )

    @TrainerPlugin.hook
    def after_setup(self, **training_parameters: Any) -> None:
        """Log the training parameters (plain values as they are, others as text), where the logger supports it."""
        params = {name: _hyperparameter(value) for name, value in training_parameters.items()}
        for logger in self.loggers:
            with contextlib.suppress(NotImplementedError):  # Fabric's CSVLogger keeps no hyperparameters
                logger.log_hyperparams(params)

    @TrainerPlugin.hook
    def metric_recorded(self, record: MetricRecord) -> None:
        """Forward one flair metric record."""
        metrics = _scalars(record)
        if metrics:
            for logger in self.loggers:
                logger.log_metrics(metrics, step=record.global_step)

    @TrainerPlugin.hook
    def _training_finally(self, **kw: Any) -> None:
        """Flush and close the loggers."""
        for logger in self.loggers:
            logger.finalize("success")

    def __str__(self) -> str:
        return f"LightningLoggerPlugin({', '.join(type(logger).__name__ for logger in self.loggers)})"
