"""The one loop of sharded prediction, for ``evaluate`` and ``predict`` alike: a rank predicts its whole batches with
the model's own ``predict``, records the labels flair put on them and what ``predict`` returned, and global rank 0
gathers every rank's batches."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from flair.data import DataPoint
from lightning.fabric import Fabric

from flair_fabric.distributed.collectives import gather_to_global_zero
from flair_fabric.evaluation.predictions import RecordedLabel, UnsupportedPrediction, record_labels

Labels = dict[str, list[RecordedLabel]]
"""A data point's predicted labels by label name."""


def batches_of_rank(size: int, batch_size: int, rank: int, world_size: int) -> list[tuple[int, range]]:
    """The batches rank ``rank`` predicts, as ``(batch number, positions)``: whole batches, dealt round robin."""
    starts = range(0, size, batch_size)
    return [
        (number, range(start, min(start + batch_size, size)))
        for number, start in enumerate(starts)
        if number % world_size == rank
    ]


def fingerprint(data_point: DataPoint) -> int:
    """A cheap checksum of a data point's text, to check that every rank predicted the same data."""
    return zlib.crc32(data_point.unlabeled_identifier.encode("utf-8"))


@dataclass
class PredictedBatch:
    """What one rank's ``predict`` produced for one batch."""

    number: int
    """The batch's number in flair's order of the data."""
    positions: list[int]
    """The batch's positions in that order."""
    labels: list[Labels]
    """Per data point, its predicted labels by name."""
    returned: Any
    """What ``predict`` returned: ``None``, a loss, or ``(loss sum, count)``; tensors on the CPU."""
    fingerprints: list[int]
    rank: int


class Unmovable(str):
    """Why a rank's predicted labels cannot be moved to another process (a label somewhere no address reaches)."""


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, tuple):
        return tuple(_on_cpu(item) for item in value)
    return value


def predict_batches(
    model: Any,
    batches: Iterable[tuple[int, list[int], list[DataPoint]]],
    names: list[str],
    predict_kwargs: dict[str, Any],
    rank: int,
    after_batch: Callable[[list[DataPoint]], None] | None = None,
) -> list[PredictedBatch] | Unmovable:
    """Predict each ``(number, positions, data points)`` batch with ``model.predict(batch, **predict_kwargs)`` (one
    call per batch, so that every data point meets the neighbours and padding it meets in one process) after removing
    the labels named ``names``, and record them; :class:`Unmovable` (and nothing else) if a label cannot be moved."""
    predicted = []
    with torch.no_grad():
        for number, positions, batch in batches:
            for data_point in batch:
                for name in names:
                    data_point.remove_labels(name)
            returned = model.predict(batch, **predict_kwargs)
            try:
                labels = [{name: record_labels(data_point, name) for name in names} for data_point in batch]
            except UnsupportedPrediction as error:
                return Unmovable(str(error))
            if after_batch is not None:
                after_batch(batch)
            fingerprints = [fingerprint(data_point) for data_point in batch]
            predicted.append(PredictedBatch(number, positions, labels, _on_cpu(returned), fingerprints, rank))
    return predicted


def gather_batches(
    fabric: Fabric, predicted: list[PredictedBatch] | Unmovable
) -> tuple[list[PredictedBatch], list[Unmovable]] | None:
    """Every rank's batches (in batch order) and reasons on global rank 0; ``None`` elsewhere. A collective."""
    gathered = gather_to_global_zero(fabric, predicted)
    if gathered is None:
        return None
    unmovable = [reason for reason in gathered if isinstance(reason, Unmovable)]
    batches = [batch for rank_batches in gathered if isinstance(rank_batches, list) for batch in rank_batches]
    return sorted(batches, key=lambda batch: batch.number), unmovable
