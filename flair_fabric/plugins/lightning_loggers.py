"""flair's metric records forwarded to Lightning's loggers (``CSVLogger``, ``TensorBoardLogger``, any
``lightning.fabric.loggers.Logger``), written by global rank 0 only."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from flair.trainers.plugins import MetricRecord, TrainerPlugin
from lightning.fabric.loggers import Logger

from flair_fabric.plugins.rank_zero import GlobalZeroPlugin
from flair_fabric.plugins.trackers import Tracker


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
    Lightning loggers on global rank 0 only, at the optimizer step it belongs to (the run's steps so far: an epoch's
    metrics at its last step, an evaluation of ``val_check_interval`` at its step), so that trackers with one step
    axis (W&B) hold them all in order; under flair's own trainer at the record's step.

    ``trainer.train(..., plugins=[LightningLoggerPlugin(CSVLogger("logs"))])``; experiment trackers as
    :mod:`~flair_fabric.plugins.trackers` recipes (``MLflowTracker(...)``, ``WandbTracker(...)``): their loggers are
    made when the first number is logged, continuing the tracker run a resumed checkpoint recorded. The training
    parameters (or ``hyperparameters``, as the command line gives the resolved config) are logged as
    hyperparameters; the loggers are finalized when training ends.
    """

    def __init__(
        self, loggers: Logger | Tracker | Iterable[Logger | Tracker], hyperparameters: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.given_hyperparameters = hyperparameters
        self.items = [loggers] if isinstance(loggers, (Logger, Tracker)) else list(loggers)
        if not self.items or not all(isinstance(item, (Logger, Tracker)) for item in self.items):
            raise TypeError(
                "LightningLoggerPlugin(loggers=...) takes a lightning.fabric.loggers.Logger (e.g. CSVLogger(...),"
                " TensorBoardLogger(...)), a tracker (MLflowTracker(...), WandbTracker(...)) or a list of them."
            )
        self.continued: list[str | None] = [None] * len(self.items)  # tracker runs a resume hands back
        self._made: list[Logger] | None = None
        self._hyperparameters: dict[str, Any] | None = None

    def made_loggers(self) -> list[Logger]:
        """The loggers, made on first use (trackers continue the runs a resume handed back; not a property: flair's
        ``attach_to`` reads every attribute)."""
        if self._made is None:
            self._made = [
                item.make(run_id) if isinstance(item, Tracker) else item
                for item, run_id in zip(self.items, self.continued, strict=True)
            ]
            if self._hyperparameters is not None and not any(self.continued):  # a continued run keeps its own
                self._log_hyperparameters(self._hyperparameters)
        return self._made

    def tracker_runs(self) -> list[str | None]:
        """Per item, the tracker run its logger logs to (``None`` for a plain logger, or before any logging)."""
        if self._made is None:
            return list(self.continued)
        return [
            item.run_id(logger) if isinstance(item, Tracker) else None
            for item, logger in zip(self.items, self._made, strict=True)
        ]

    def continue_runs(self, runs: list[str | None]) -> None:
        """A resume: the trackers continue these runs (before anything was logged)."""
        if self._made is None and len(runs) == len(self.items):
            self.continued = list(runs)

    @TrainerPlugin.hook
    def after_setup(self, **training_parameters: Any) -> None:
        """Log the training parameters (plain values as they are, others as text), where the logger supports it;
        with trackers, when their loggers are made."""
        self.base_path = Path(training_parameters["base_path"]) if "base_path" in training_parameters else None
        given = self.given_hyperparameters if self.given_hyperparameters is not None else training_parameters
        params = {name: _hyperparameter(value) for name, value in given.items()}
        if any(isinstance(item, Tracker) for item in self.items):
            self._hyperparameters = params
        else:
            self._log_hyperparameters(params)

    def _log_hyperparameters(self, params: dict[str, Any]) -> None:
        for logger in self.made_loggers():
            with contextlib.suppress(NotImplementedError):  # Fabric's CSVLogger keeps no hyperparameters
                logger.log_hyperparams(params)

    @TrainerPlugin.hook
    def metric_recorded(self, record: MetricRecord) -> None:
        """Forward one flair metric record."""
        metrics = _scalars(record)
        steps = getattr(self.trainer, "optimizer_steps", None)  # FabricTrainer's; flair's trainer has none
        if metrics:
            for logger in self.made_loggers():
                logger.log_metrics(metrics, step=steps if steps is not None else record.global_step)

    @TrainerPlugin.hook
    def after_training(self, **kw: Any) -> None:
        """Store the model files flair wrote with the runs of trackers that ask for it."""
        base_path = getattr(self, "base_path", None)
        for item, logger in zip(self.items, self.made_loggers(), strict=True):
            if isinstance(item, Tracker) and item.log_model_files and base_path is not None:
                for name in ("best-model.pt", "final-model.pt"):
                    if (base_path / name).is_file():
                        item.log_file(logger, base_path / name)

    @TrainerPlugin.hook
    def _training_finally(self, **kw: Any) -> None:
        """Flush and close the loggers."""
        for item, logger in zip(self.items, self.made_loggers(), strict=True):
            if isinstance(item, Tracker):
                item.close(logger)
            else:
                logger.finalize("success")

    def __str__(self) -> str:
        return f"LightningLoggerPlugin({', '.join(type(item).__name__ for item in self.items)})"
