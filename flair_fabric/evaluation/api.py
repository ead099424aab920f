"""``flair_fabric.evaluate``: score a trained flair model outside training, with the prediction split across
processes started (or found) by Fabric exactly as for training."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import flair
from flair.data import _len_dataset
from flair.datasets import FlairDatapointDataset
from flair.training_utils import Result
from lightning.fabric import Fabric
from torch.utils.data import Dataset

from flair_fabric.evaluation.predictions import RecordedLabel, UnsupportedPrediction, record_labels, restore_labels
from flair_fabric.evaluation.sharded import PREDICTED, evaluate_across_ranks, ready_for_inference
from flair_fabric.launch.config import DevicesArgument, StrategyArgument, build_fabric, make_launch_config
from flair_fabric.launch.workers import run_on_every_rank, starts_workers

log = logging.getLogger("flair")


@dataclass
class _EvaluationJob:
    """What every rank needs to score its share."""

    model: flair.nn.Model
    data: Dataset
    out_path: Path | None
    evaluate_kwargs: dict[str, Any]
    return_predictions: bool  # the ranks are workers: the caller's data points get rank 0's predicted labels


def _evaluate_on_rank(fabric: Fabric, job: _EvaluationJob) -> tuple[Result, list[list[RecordedLabel]] | None]:
    with ready_for_inference(fabric, job.model):
        result = evaluate_across_ranks(fabric, job.model, job.data, out_path=job.out_path, **job.evaluate_kwargs)
    predictions = None
    if job.return_predictions and fabric.is_global_zero:  # after flair's evaluate, rank 0 holds every prediction
        try:
            predictions = [record_labels(job.data[i], PREDICTED) for i in range(_len_dataset(job.data))]
        except UnsupportedPrediction as error:
            log.warning(f"the caller's data points do not get the predicted labels: {error}")
    return result, predictions


def evaluate(
    model: flair.nn.Model,
    data_points: list | Dataset,
    gold_label_type: str,
    *,
    out_path: str | Path | None = None,
    accelerator: str = "auto",
    devices: DevicesArgument = "auto",
    num_nodes: int = 1,
    strategy: StrategyArgument = "auto",
    precision: str | int | None = None,
    collective_timeout: float | timedelta | None = None,
    **evaluate_kwargs: Any,
) -> Result:
    """``model.evaluate(data_points, gold_label_type, ...)`` with the prediction split across processes.

    Takes flair's ``evaluate`` arguments (``mini_batch_size``, ``main_evaluation_metric``, ``exclude_labels``,
    ``gold_label_dictionary``, ``return_loss``, ``embedding_storage_mode``, ...) plus Lightning's ``accelerator``,
    ``devices``, ``num_nodes`` and ``strategy``, which start processes as :class:`~flair_fabric.FabricTrainer` does.
    Returns the :class:`~flair.training_utils.Result` flair's ``evaluate`` returns in one process; only global
    rank 0 writes ``out_path``. Whole batches of ``mini_batch_size`` are dealt to the ranks, so a split needs at
    least ``devices`` batches to keep every process busy.
    """
    config = make_launch_config(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        use_amp=False,
        collective_timeout=collective_timeout,
    )
    data = data_points if isinstance(data_points, Dataset) else FlairDatapointDataset(data_points)
    fabric = build_fabric(config)
    path = Path(out_path) if out_path is not None else None
    kwargs = {"gold_label_type": gold_label_type, **evaluate_kwargs}
    job = _EvaluationJob(model, data, path, kwargs, return_predictions=starts_workers(fabric))
    result, predictions = run_on_every_rank(
        fabric, _evaluate_on_rank, job, config.collective_timeout, result_types=[Result, RecordedLabel]
    )
    for index, labels in enumerate(predictions or []):  # workers predicted on copies: label the caller's data too
        data_point = data[index]
        data_point.remove_labels(PREDICTED)
        restore_labels(data_point, PREDICTED, labels)
    return result
