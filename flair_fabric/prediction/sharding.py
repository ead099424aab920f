"""Prediction split across ranks, each data point predicted in exactly the batch flair's ``predict`` would put it in.

flair's ``predict`` sorts the data points it is given by length (longest first, a stable sort) and cuts them into
batches of ``mini_batch_size``. Here the same sort and the same cut are made over all the data, and batch ``b`` is
predicted by rank ``b % world_size`` with flair's own ``predict`` (one batch per call): every data point meets the
same neighbours and padding as in one process, so labels and scores are flair's. The ranks' labels go to global
rank 0 (:mod:`flair_fabric.evaluation.predictions` moves them between processes), which puts them on its data
points; :func:`predict_across_ranks` returns them to every rank that asks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import flair
from flair.data import DataPoint, Sentence
from lightning.fabric import Fabric

from flair_fabric.distributed.collectives import any_rank
from flair_fabric.evaluation.batches import Labels, Unmovable, batches_of_rank, gather_batches, predict_batches
from flair_fabric.evaluation.predictions import Address, RecordedLabel, restore_labels


def flair_order(data_points: Sequence[DataPoint]) -> list[int]:
    """Indices of ``data_points`` in the order flair's ``predict`` batches them: by length, longest first."""
    if not data_points or not isinstance(data_points[0], Sentence):
        return list(range(len(data_points)))
    return sorted(range(len(data_points)), key=lambda index: len(data_points[index]), reverse=True)


def label_names_of(model: flair.nn.Model, label_name: str | None) -> list[str]:
    """The label names flair's ``predict`` writes: ``label_name``, else the model's label type (every task's, for a
    multitask model)."""
    if label_name is not None:
        return [label_name]
    tasks = getattr(model, "tasks", None)
    models = list(tasks.values()) if isinstance(tasks, dict) else [model]
    return [getattr(each, "label_type", None) or "label" for each in models]


def put_labels(data_point: DataPoint, labels: Labels) -> None:
    """Give ``data_point`` these predicted labels in place of any it had under their names."""
    for name, recorded in labels.items():
        data_point.remove_labels(name)
        restore_labels(data_point, name, recorded)


@dataclass
class Predicted:
    """Global rank 0's view after a prediction: every data point's labels (input order) and, with
    ``return_loss=True``, the summed loss and label count flair's ``predict`` returns."""

    labels: list[Labels]
    loss: tuple[float, int] | None = None

    def to_json(self) -> str | None:
        """The labels as JSON text, which a process reads back many times faster than the pickled objects (PyTorch's
        data-only unpickler is pure Python); ``None`` if some label carries metadata (JSON could change its types)."""
        if any(label.metadata for each in self.labels for recorded in each.values() for label in recorded):
            return None
        labels = [
            {name: [[label.address, label.value, label.score] for label in recorded] for name, recorded in each.items()}
            for each in self.labels
        ]
        return json.dumps({"labels": labels, "loss": self.loss})

    @classmethod
    def from_json(cls, text: str) -> Predicted:
        """What :meth:`to_json` wrote."""
        plain = json.loads(text)
        labels = [
            {
                name: [RecordedLabel(_as_address(address), value, score) for address, value, score in recorded]
                for name, recorded in each.items()
            }
            for each in plain["labels"]
        ]
        return cls(labels, tuple(plain["loss"]) if plain["loss"] is not None else None)


def _as_address(plain: list) -> Address:
    return tuple(_as_address(part) if isinstance(part, list) else part for part in plain)


class NotSplittable(RuntimeError):
    """The model puts labels where they cannot be moved between processes; every rank raises it together."""


def predict_across_ranks(
    fabric: Fabric,
    model: flair.nn.Model,
    data_points: Sequence[DataPoint],
    predict_kwargs: dict[str, Any],
    label_on_global_zero: bool = True,
) -> Predicted | None:
    """Predict ``data_points`` (the same on every rank) with the batches dealt to the ranks. On global rank 0 the
    labels come back with the loss, if asked for, and land on its data points unless ``label_on_global_zero`` is
    false (rank 0 is a worker whose data points nobody reads); ``None`` on the other ranks. Raises
    :class:`NotSplittable` on every rank if some rank's labels cannot be moved."""
    names = label_names_of(model, predict_kwargs.get("label_name"))
    mini_batch_size = predict_kwargs.get("mini_batch_size", 32)
    order = flair_order(data_points)
    mine = batches_of_rank(len(order), mini_batch_size, fabric.global_rank, fabric.world_size)
    batches = (
        (number, [order[position] for position in positions], [data_points[order[position]] for position in positions])
        for number, positions in mine
    )
    predicted = predict_batches(model, batches, names, predict_kwargs, fabric.global_rank)
    if any_rank(fabric, isinstance(predicted, Unmovable)):
        problem = predicted if isinstance(predicted, Unmovable) else None
        raise NotSplittable(problem or "another rank predicted labels that cannot be moved between processes")
    gathered = gather_batches(fabric, predicted)
    if gathered is None:
        return None
    every_batch, _ = gathered
    every = {
        index: labels for batch in every_batch for index, labels in zip(batch.positions, batch.labels, strict=True)
    }
    if label_on_global_zero:  # the other ranks' labels on this process's data points
        own = {index for batch in cast(list, predicted) for index in batch.positions}
        for index, labels in every.items():
            if index not in own:
                put_labels(data_points[index], labels)
    loss = None
    if predict_kwargs.get("return_loss"):  # flair's (loss sum, count) of every batch, summed over the ranks
        returned = [batch.returned for batch in every_batch if isinstance(batch.returned, tuple)]
        loss = (sum(float(part[0]) for part in returned), sum(int(part[1]) for part in returned))
    return Predicted([every[index] for index in range(len(data_points))], loss)
