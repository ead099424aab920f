"""Experiment trackers for :class:`~flair_fabric.plugins.lightning_loggers.LightningLoggerPlugin`: MLflow (Lightning's
``MLFlowLogger``) and Weights & Biases (wandb's own Fabric ``WandbLogger``).

A tracker is a recipe, not a logger: the plugin makes its logger on global rank 0 when the first number is logged,
after a resume has handed back the tracker run the checkpoint recorded, so a resumed job continues the same tracker
run (one run per job, never one per rank). Both packages are optional extras: ``pip install flair-fabric[mlflow]``,
``pip install flair-fabric[wandb]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import Logger

from flair_fabric.plugins.mlflow_store import check_mlflow_store, tracking_uri_used


class Tracker(ABC):
    """How to make a tracker's logger, continuing a recorded run, and how to name the run it logs to."""

    extra = ""
    log_model_files = False

    @abstractmethod
    def make(self, run_id: str | None) -> Logger:
        """The logger: a new tracker run, or the run ``run_id`` continued."""

    @abstractmethod
    def run_id(self, logger: Logger) -> str:
        """The id of the tracker run ``logger`` logs to."""

    @abstractmethod
    def log_file(self, logger: Logger, path: Path) -> None:
        """Store ``path`` with the run (a model file)."""

    def close(self, logger: Logger) -> None:
        """End the job's part of the run: everything logged is written."""
        logger.finalize("success")

    def _missing(self, error: ImportError) -> ImportError:
        return ImportError(
            f"{type(self).__name__} needs the {self.extra} package: pip install 'flair-fabric[{self.extra}]' ({error})"
        )


@dataclass
class MLflowTracker(Tracker):
    """An MLflow run (Lightning's ``MLFlowLogger``); ``tracking_uri`` as MLflow takes it (``file:...`` for a folder;
    default: ``MLFLOW_TRACKING_URI``, else ``file:./mlruns``). ``log_model_files``: the model files flair writes
    (``best-model.pt``, ``final-model.pt``) become the run's artifacts.

    Made, it checks that MLflow will take the store: a folder needs ``MLFLOW_ALLOW_FILE_STORE=true`` with MLflow 3.13
    and later (a ``ValueError`` says so before training starts, instead of MLflow at the first logged number)."""

    experiment_name: str = "flair-fabric"
    tracking_uri: str | None = None
    run_name: str | None = None
    tags: dict[str, Any] | None = None
    log_model_files: bool = False
    extra = "mlflow"

    def __post_init__(self) -> None:
        check_mlflow_store(self.tracking_uri)

    def make(self, run_id: str | None) -> Logger:
        try:
            import mlflow  # noqa: F401  (MLFlowLogger imports it only when it first logs)
            from lightning.pytorch.loggers import MLFlowLogger
        except ImportError as error:
            raise self._missing(error) from None
        return MLFlowLogger(
            experiment_name=self.experiment_name,
            run_name=self.run_name,
            tracking_uri=tracking_uri_used(self.tracking_uri),
            tags=self.tags,
            run_id=run_id,
        )

    def run_id(self, logger: Logger) -> str:
        return str(logger.run_id)  # type: ignore[attr-defined]

    def log_file(self, logger: Logger, path: Path) -> None:
        logger.experiment.log_artifact(self.run_id(logger), str(path))  # type: ignore[attr-defined]


@dataclass
class WandbTracker(Tracker):
    """A Weights & Biases run (wandb's Fabric ``WandbLogger``); ``offline=True`` (or ``WANDB_MODE=offline``) writes it
    under ``save_dir`` only. ``settings``: further ``wandb.init`` arguments. ``log_model_files``: the model files
    flair writes are saved with the run."""

    project: str | None = None
    name: str | None = None
    save_dir: str = "."
    offline: bool = False
    log_model_files: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    extra = "wandb"

    def make(self, run_id: str | None) -> Logger:
        try:
            from wandb.integration.lightning.fabric import WandbLogger
        except ImportError as error:
            raise self._missing(error) from None
        resume = {"id": run_id, "resume": "allow"} if run_id is not None else {}
        options = {**self.settings, **resume}
        return WandbLogger(
            project=self.project, name=self.name, save_dir=self.save_dir, offline=self.offline, **options
        )

    def run_id(self, logger: Logger) -> str:
        return str(logger.experiment.id)  # type: ignore[attr-defined]

    def log_file(self, logger: Logger, path: Path) -> None:
        logger.experiment.save(str(path), base_path=str(path.parent), policy="now")  # type: ignore[attr-defined]

    def close(self, logger: Logger) -> None:
        """Finish the wandb run (a forked rank exits without running wandb's exit hook, which would finish it)."""
        logger.finalize("success")
        logger.experiment.finish()  # type: ignore[attr-defined]
