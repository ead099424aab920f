"""A prediction batch that runs out of device memory is predicted again in halves (evaluate and predict, every rank on
its own): the same labels, scores and loss as flair's own one-pass prediction; a data point that does not fit alone
is named. CPU tests cannot run out of device memory, so a model raises ``torch.OutOfMemoryError`` as CUDA does."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from torch.multiprocessing.spawn import ProcessRaisedException

import flair_fabric
from flair_fabric import FabricTrainer
from flair_fabric.datasets import TREC_LABEL_TYPE

from ..support import small_trec, tiny_text_classifier


class _HoldsFewPoints(TextClassifier):
    """Runs out of memory, as a GPU would, on a ``predict`` call with more than ``most`` data points."""

    most = 3
    calls: list[int] = []

    def predict(self, sentences: Any, *args: Any, **kwargs: Any) -> Any:
        size = len(sentences) if isinstance(sentences, list) else 1
        type(self).calls.append(size)
        if size > self.most:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {size} > {self.most} data points)")
        return super().predict(sentences, *args, **kwargs)


def _limited_copy(model: TextClassifier, most: int) -> TextClassifier:
    limited = copy.deepcopy(model)
    limited.__class__ = _HoldsFewPoints
    _HoldsFewPoints.most, _HoldsFewPoints.calls = most, []
    return limited


@contextlib.contextmanager
def _not_retried_fails() -> Iterator[None]:
    """An out-of-memory error that reaches the caller (injected, or the error that names a data point) fails the test:
    a batch was not predicted in halves down to one data point (a worker's error comes as ProcessRaisedException)."""
    try:
        yield
    except (RuntimeError, ProcessRaisedException) as error:  # torch.OutOfMemoryError is a RuntimeError
        if "out of memory" in str(error):
            pytest.fail(f"a batch that ran out of memory was not predicted in halves down to one data point: {error}")
        raise


def _trained() -> tuple[TextClassifier, Any]:
    corpus = small_trec(train_size=48, dev_size=30, test_size=12)
    model = tiny_text_classifier(corpus)
    return model, corpus


@pytest.mark.multiprocess
def test_evaluate_on_two_ranks_retries_in_halves_and_equals_flairs_evaluate(tmp_path: Path) -> None:
    model, corpus = _trained()
    dev = list(corpus.dev)
    single = model.evaluate(dev, TREC_LABEL_TYPE, mini_batch_size=8)  # flair, one process, whole batches
    with _not_retried_fails():
        sharded = flair_fabric.evaluate(
            _limited_copy(model, most=1),
            dev,
            TREC_LABEL_TYPE,
            mini_batch_size=8,
            accelerator="cpu",
            devices=2,
            strategy="ddp_fork",
        )
    assert sharded.main_score == single.main_score
    assert sharded.detailed_results == single.detailed_results
    assert sharded.scores["loss"] == pytest.approx(single.scores["loss"], rel=1e-6)


def test_predict_retries_in_halves_with_flairs_labels_and_scores_and_names_a_point_that_never_fits() -> None:
    model, corpus = _trained()
    sentences = [copy.deepcopy(sentence) for sentence in corpus.dev]
    expected = [copy.deepcopy(sentence) for sentence in corpus.dev]
    model.predict(expected, mini_batch_size=8, label_name="predicted", return_probabilities_for_all_classes=True)
    limited = _limited_copy(model, most=1)
    with _not_retried_fails():
        flair_fabric.predict(
            limited,
            sentences,
            mini_batch_size=8,
            label_name="predicted",
            accelerator="cpu",
            devices=1,
            return_probabilities_for_all_classes=True,
        )
    assert max(_HoldsFewPoints.calls) == 8 and min(_HoldsFewPoints.calls) == 1, "whole batches first, then halves"

    def labels(points: list) -> list:
        return [[(label.value, round(label.score, 6)) for label in point.get_labels("predicted")] for point in points]

    assert labels(sentences) == labels(expected)
    with pytest.raises(RuntimeError, match=r"predicting one data point alone runs out of memory: '.+'"):
        flair_fabric.predict(
            _limited_copy(model, most=0), sentences[:4], mini_batch_size=8, accelerator="cpu", devices=1
        )


def test_evaluate_in_one_process_retries_in_halves_and_equals_flairs_evaluate() -> None:
    model, corpus = _trained()
    dev = list(corpus.dev)
    single = model.evaluate(copy.deepcopy(dev), TREC_LABEL_TYPE, mini_batch_size=8)  # flair, whole batches
    with _not_retried_fails():
        result = flair_fabric.evaluate(
            _limited_copy(model, most=1), dev, TREC_LABEL_TYPE, mini_batch_size=8, accelerator="cpu", devices=1
        )
    assert max(_HoldsFewPoints.calls) == 8 and min(_HoldsFewPoints.calls) == 1, "whole batches first, then halves"
    assert result.main_score == single.main_score
    assert result.detailed_results == single.detailed_results
    assert result.scores["loss"] == pytest.approx(single.scores["loss"], rel=1e-6)


def _loss_rows(folder: Path) -> list[dict[str, str]]:
    lines = [line.split("\t") for line in (folder / "loss.tsv").read_text().splitlines()]
    return [{t: v for t, v in zip(lines[0], row, strict=True) if t != "TIMESTAMP"} for row in lines[1:]]


def test_training_evaluations_retry_in_halves_and_write_flairs_dev_scores(tmp_path: Path) -> None:
    """The dev evaluations of a one-process training run (batches of 8), on a model that runs out of memory on more
    than one data point: loss.tsv holds the dev scores and losses of flair's own trainer with the unlimited model."""
    model, corpus = _trained()
    options = {
        "max_epochs": 2,
        "mini_batch_size": 8,
        "eval_batch_size": 8,
        "learning_rate": 0.1,
        "shuffle": False,
        # embeddings flair keeps between evaluations would be computed again for a retried batch (docs/evaluation.md)
        "embeddings_storage_mode": "none",
        "use_final_model_for_eval": True,
        "save_final_model": False,
    }
    ModelTrainer(copy.deepcopy(model), corpus).train(tmp_path / "flair", **options)
    with _not_retried_fails():
        FabricTrainer(_limited_copy(model, most=1), corpus).train(
            tmp_path / "fabric", accelerator="cpu", devices=1, **options
        )
    assert max(_HoldsFewPoints.calls) == 8 and min(_HoldsFewPoints.calls) == 1, "whole batches first, then halves"
    ours, flairs = _loss_rows(tmp_path / "fabric"), _loss_rows(tmp_path / "flair")
    assert len(ours) == len(flairs) == options["max_epochs"]
    for row, flair_row in zip(ours, flairs, strict=True):
        assert row.keys() == flair_row.keys()
        # the halves' losses summed in another order: loss.tsv's 4 decimals may differ in the last one
        assert float(row["DEV_LOSS"]) == pytest.approx(float(flair_row["DEV_LOSS"]), abs=1e-4)
        assert {t: v for t, v in row.items() if t != "DEV_LOSS"} == {
            t: v for t, v in flair_row.items() if t != "DEV_LOSS"
        }
