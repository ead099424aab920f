"""``loss.tsv`` with a row per evaluation, inside epochs too (``val_check_interval``), each naming its step.

flair's ``LossFilePlugin`` writes one row per epoch: it takes the epoch from ``before_training_epoch`` and writes the
header with epoch 1's row. With evaluations inside epochs that gives rows without an epoch and a header per
evaluation of epoch 1. :class:`StepLossFilePlugin` keeps flair's columns, values and formats and adds ``STEP`` (the
optimizer step the row was evaluated after); the header is written once, when the file is empty, and a resumed run
continues under the header the file has.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from flair.trainers.plugins import LossFilePlugin, TrainerPlugin
from flair.trainers.plugins.metric_records import MetricName

STEP = MetricName("step")


class StepLossFilePlugin(LossFilePlugin):
    """flair's ``loss.tsv`` with a ``STEP`` column and a row after every evaluation (global rank 0 only)."""

    def __init__(self, base_path: Any, epoch: int, step_of: Callable[[], int]) -> None:
        super().__init__(base_path=base_path, epoch=epoch)
        self.step_of = step_of
        epoch_name = MetricName("epoch")
        self.headers = {epoch_name: self.headers[epoch_name], STEP: "STEP"} | {
            name: title for name, title in self.headers.items() if name != epoch_name
        }
        self.columns_chosen = False

    @TrainerPlugin.hook
    def after_evaluation(self, epoch: int, **kw: Any) -> None:
        """Write this evaluation's row (and, into an empty file, the header first)."""
        row: dict[MetricName, Any] = dict(self.current_row or {})
        row[MetricName("epoch")] = epoch
        row[STEP] = self.step_of()
        row[MetricName("timestamp")] = f"{datetime.now():%H:%M:%S}"
        with open(self.loss_txt, "a+", encoding="utf-8") as loss_file:
            loss_file.seek(0)
            header = loss_file.readline().rstrip("\n")
            if not self.columns_chosen:  # flair's rule: the columns the first row has; a resumed run keeps the file's
                kept = (
                    set(header.split("\t"))
                    if header
                    else {title for name, title in self.headers.items() if name in row}
                )
                self.headers = {name: title for name, title in self.headers.items() if title in kept}
                self.columns_chosen = True
            missing = [title for name, title in self.headers.items() if name not in row]
            if missing:
                raise ValueError(f"loss.tsv: no value for {', '.join(missing)} after step {row[STEP]}")
            if not header:
                loss_file.write("\t".join(self.headers.values()) + "\n")
            loss_file.write("\t".join(str(row[name]) for name in self.headers) + "\n")
        self.current_row = {}
