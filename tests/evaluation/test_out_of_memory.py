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

import flair_fabric
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
    """An injected out-of-memory error that reaches the caller fails the test (the batch was not retried)."""
    try:
        yield
    except Exception as error:
        if "out of memory (injected" in str(error):
            pytest.fail(f"a batch that ran out of memory was not predicted in parts: {error}")
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
            _limited_copy(model, most=3),
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
    limited = _limited_copy(model, most=2)
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
    assert max(_HoldsFewPoints.calls) == 8 and min(_HoldsFewPoints.calls) <= 2, "whole batches first, then halves"

    def labels(points: list) -> list:
        return [[(label.value, round(label.score, 6)) for label in point.get_labels("predicted")] for point in points]

    assert labels(sentences) == labels(expected)
    with pytest.raises(RuntimeError, match=r"predicting one data point alone runs out of memory: '.+'"):
        flair_fabric.predict(
            _limited_copy(model, most=0), sentences[:4], mini_batch_size=8, accelerator="cpu", devices=1
        )
