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
import torch
from flair.data import DataPoint, Sentence
from lightning.fabric import Fabric

from flair_fabric.distributed.collectives import gather_to_global_zero
from flair_fabric.evaluation.predictions import (
    Address,
    RecordedLabel,
    UnsupportedPrediction,
    record_labels,
    restore_labels,
)
from flair_fabric.evaluation.sharded import batches_of_rank


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


Labels = dict[str, list[RecordedLabel]]
"""A data point's predicted labels by label name."""


def _record(data_point: DataPoint, names: list[str]) -> Labels:
    return {name: record_labels(data_point, name) for name in names}


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


def _agreed_problem(fabric: Fabric, problem: str | None) -> str | None:
    """``problem`` (or a stand-in for another rank's) if any rank had one; one all-reduce, on every rank."""
    if fabric.world_size > 1:
        flag = torch.tensor(float(problem is not None), device=fabric.device)
        if cast(torch.Tensor, fabric.all_reduce(flag, reduce_op="sum")).item() > 0:
            return problem or "another rank predicted labels that cannot be moved between processes"
    return problem


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
    predicted: dict[int, Labels] = {}
    loss_sum, count = 0.0, 0
    problem = None
    with torch.no_grad():
        for _, positions in mine:
            batch = [data_points[order[position]] for position in positions]
            for data_point in batch:
                for name in names:
                    data_point.remove_labels(name)
            returned = cast(Any, model).predict(batch, **predict_kwargs)
            if predict_kwargs.get("return_loss") and isinstance(returned, tuple):
                loss_sum, count = loss_sum + float(returned[0]), count + int(returned[1])
            try:
                predicted.update({order[p]: _record(data_points[order[p]], names) for p in positions})
            except UnsupportedPrediction as error:
                problem = str(error)
                break
    problem = _agreed_problem(fabric, problem)
    if problem is not None:
        raise NotSplittable(problem)
    gathered = gather_to_global_zero(fabric, (predicted, loss_sum, count))
    if gathered is None:
        return None
    every = {index: labels for rank_labels, _, _ in gathered for index, labels in rank_labels.items()}
    for index, labels in every.items() if label_on_global_zero else ():
        if index not in predicted:  # another rank predicted it: put its labels on this process's data point
            put_labels(data_points[index], labels)
    loss = (sum(part[1] for part in gathered), sum(part[2] for part in gathered))
    return Predicted(
        [every[index] for index in range(len(data_points))], loss if predict_kwargs.get("return_loss") else None
    )
