"""``flair_fabric.evaluate``: score a trained flair model outside training, with the prediction split across
processes started (or found) by Fabric exactly as for training."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import flair
from flair.data import _len_dataset
from flair.datasets import FlairDatapointDataset
from flair.training_utils import Result
from lightning.fabric import Fabric
from torch.utils.data import Dataset

from flair_fabric.data.stored import builds_anew
from flair_fabric.evaluation.predictions import RecordedLabel, UnsupportedPrediction, record_labels, restore_labels
from flair_fabric.evaluation.sharded import PREDICTED, evaluate_across_ranks, ready_for_inference
from flair_fabric.launch.arguments import take_lightning_arguments, takes_lightning_arguments
from flair_fabric.launch.config import make_launch_config
from flair_fabric.launch.runner import Job, run_job

log = logging.getLogger("flair")


class EvaluationJob(Job):
    """``model.evaluate`` with the prediction split across the ranks; after workers, the caller's data points get rank
    0's predicted labels, as after flair's evaluate."""

    result_types: ClassVar[tuple[type, ...]] = (Result, RecordedLabel)

    def __init__(self, model: flair.nn.Model, data: Dataset, out_path: Path | None, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.data, self.out_path, self.evaluate_kwargs = model, data, out_path, kwargs
        self.in_workers = False

    def for_workers(self) -> Job:
        copy = EvaluationJob(self.model, self.data, self.out_path, self.evaluate_kwargs)
        copy.in_workers = True  # the workers evaluate copies: rank 0 sends its predictions back
        return copy

    def run_on_rank(self, fabric: Fabric) -> tuple[Result, list[list[RecordedLabel]] | None]:
        self.position.at("the sharded evaluation")
        with ready_for_inference(fabric, self.model):
            result = evaluate_across_ranks(
                fabric, self.model, self.data, out_path=self.out_path, **self.evaluate_kwargs
            )
        predictions = None
        # after flair's evaluate, rank 0 holds every prediction (a mapped split's data points hold none: new each read)
        if self.in_workers and fabric.is_global_zero and not builds_anew(self.data):
            try:
                predictions = [record_labels(self.data[i], PREDICTED) for i in range(_len_dataset(self.data))]
            except UnsupportedPrediction as error:
                log.warning(f"the caller's data points do not get the predicted labels: {error}")
        return result, predictions

    def hand_back(self, result: Any) -> tuple[Result, None]:
        scored, predictions = result
        for index, labels in enumerate(predictions or []):  # workers predicted on copies: label the caller's data too
            data_point = self.data[index]
            data_point.remove_labels(PREDICTED)
            restore_labels(data_point, PREDICTED, labels)
        return scored, None


@takes_lightning_arguments
def evaluate(
    model: flair.nn.Model,
    data_points: list | Dataset,
    gold_label_type: str,
    *,
    out_path: str | Path | None = None,
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
    launch = make_launch_config(**take_lightning_arguments(evaluate_kwargs).as_dict())
    data = data_points if isinstance(data_points, Dataset) else FlairDatapointDataset(data_points)
    path = Path(out_path) if out_path is not None else None
    result, _ = run_job(
        EvaluationJob(model, data, path, {"gold_label_type": gold_label_type, **evaluate_kwargs}), launch
    )
    return result
