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
from flair_fabric.evaluation.loss_labels import loss_labels_named
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


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says a device ran out of memory: CUDA's ``torch.OutOfMemoryError``, MPS's and the CPU
    allocator's ``RuntimeError``."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "MPS backend out of memory" in text or "DefaultCPUAllocator: can't allocate memory" in text
    )


def _summed(parts: list[Any]) -> Any:
    """What ``predict`` returns for a batch, from what it returned for its parts: ``None``, a loss, or ``(loss sum,
    count)`` summed (flair's losses are sums)."""
    if parts[0] is None:
        return None
    if isinstance(parts[0], tuple):
        return tuple(sum(values) for values in zip(*parts, strict=True))
    return sum(parts)


def predict_in_parts(model: Any, batch: list[DataPoint], predict_kwargs: dict[str, Any], names: list[str]) -> Any:
    """``model.predict(batch, ...)``; a batch that runs out of device memory is freed (and the labels ``names`` a
    part of it got) and predicted again in halves, and so on, down to one data point (then the error names it). Each
    data point gets the labels and scores it gets in one pass wherever the model's predictions do not depend on their
    batch. A loss asked for (``return_loss``) that cannot encode a gold label raises an error naming it."""
    try:
        with loss_labels_named(model, batch, bool(predict_kwargs.get("return_loss"))):
            return model.predict(batch, **predict_kwargs)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        failed = error
    for data_point in batch:
        data_point.clear_embeddings()
        for name in names:
            data_point.remove_labels(name)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if len(batch) == 1:
        raise RuntimeError(
            f"predicting one data point alone runs out of memory: {batch[0].unlabeled_identifier[:200]!r}"
        ) from failed
    middle = (len(batch) + 1) // 2
    halves = (batch[:middle], batch[middle:])
    return _summed([predict_in_parts(model, half, predict_kwargs, names) for half in halves])


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
    the labels named ``names``, and record them; :class:`Unmovable` (and nothing else) if a label cannot be moved. A
    batch that runs out of device memory is predicted in halves (:func:`predict_in_parts`)."""
    predicted = []
    with torch.no_grad():
        for number, positions, batch in batches:
            for data_point in batch:
                for name in names:
                    data_point.remove_labels(name)
            returned = predict_in_parts(model, batch, predict_kwargs, names)
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
