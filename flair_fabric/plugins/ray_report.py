"""The Ray report: in a Ray Train worker, each step or epoch checkpoint and each evaluation is also reported to Ray
(``ray.train.report``), so that Ray's ``RunConfig(storage_path=...)`` and ``CheckpointConfig(num_to_keep=...)`` apply
to the run's checkpoints and its metrics reach Ray's ``Result``.

A plugin on every rank: Ray requires every worker to call ``ray.train.report`` as often as the others (each call is a
barrier), and every rank reaches the same evaluations and checkpoints. Global rank 0 hands Ray the checkpoint folder
(it wrote it, complete, before the event); the other ranks report without one. Metrics are the scalars flair
recorded since the run began, newest value of each name, with the run's ``epoch`` and optimizer ``step``: Ray keeps
rank 0's. Ray Train (V2) attaches to its ``Result`` the metrics reported with a checkpoint; those of an evaluation
without one reach Ray's callbacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flair.trainers.plugins import TrainerPlugin
from flair.trainers.plugins.metric_records import MetricRecord, RecordType

from flair_fabric.plugins.rank_zero import is_global_zero

CHECKPOINT_SAVED = "_checkpoint_saved"
"""The event a run dispatches on every rank after a checkpoint is complete (``folder``, ``epoch``, ``step``)."""


class RayReportPlugin(TrainerPlugin):
    """Reports each checkpoint (global rank 0's folder) and each evaluation's metrics to Ray Train, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @TrainerPlugin.hook
    def metric_recorded(self, record: MetricRecord) -> None:
        """Keep the newest value of each scalar metric flair records (the train loss, the evaluation scores)."""
        if record.typ is RecordType.scalar:
            self.metrics["/".join(record.name.parts)] = float(record.value)

    @TrainerPlugin.hook
    def after_evaluation(self, epoch: int, **kw: Any) -> None:
        """Every rank: the evaluation's metrics to Ray."""
        self._report(epoch, folder=None)

    @TrainerPlugin.hook(CHECKPOINT_SAVED)
    def checkpoint_saved(self, folder: Path, epoch: int, step: int, **kw: Any) -> None:
        """Every rank: the checkpoint to Ray, its folder from global rank 0."""
        self._report(epoch, folder=folder, step=step)

    def _report(self, epoch: int, folder: Path | None, step: int | None = None) -> None:
        import ray.train

        if step is None:
            step = int(getattr(self.trainer, "optimizer_steps", 0))
        metrics = {**self.metrics, "epoch": epoch, "step": step}
        checkpoint = ray.train.Checkpoint.from_directory(str(folder)) if folder and is_global_zero(self) else None
        ray.train.report(metrics, checkpoint=checkpoint)

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "__name__": self.__class__.__name__}
