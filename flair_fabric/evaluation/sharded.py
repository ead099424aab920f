"""Evaluation split across ranks, scored once by flair's own ``evaluate``.

flair's ``Classifier.evaluate`` walks the data in batches of ``mini_batch_size``: it predicts each batch, collects
gold and predicted labels, then scores them with its metric code. Here the *prediction* is split: batch ``b`` is
predicted by rank ``b % world_size`` (whole batches, so each batch holds exactly the data points it holds in one
process and the model computes exactly what it computes there; no data point is predicted twice, none is padded).
The ranks send their predicted labels and per-batch losses to global rank 0, which runs flair's ``evaluate``
unchanged with a stand-in whose ``predict`` puts the gathered labels back instead of running the model. So scores,
reports, loss and the output file are flair's, computed by flair's code; rank 0 alone writes the file, and its
:class:`~flair.training_utils.Result` is broadcast so every rank takes the same decisions.

Models that override ``evaluate`` (and predictions this module cannot move) are evaluated whole on rank 0 instead,
with a warning; the number is never wrong, only not sharded.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeGuard

import flair
import torch
from flair.data import DataPoint, _len_dataset
from flair.file_utils import Tqdm
from flair.training_utils import EmbeddingStorageMode, Result, store_embeddings
from lightning.fabric import Fabric
from torch.utils.data import Dataset

from flair_fabric.distributed.stalls import wait_for_global_zero
from flair_fabric.evaluation.batches import (
    PredictedBatch,
    batches_of_rank,
    fingerprint,
    gather_batches,
    predict_batches,
    predict_in_parts,
)
from flair_fabric.evaluation.predictions import restore_labels

log = logging.getLogger("flair")
_FLAIR_EVALUATE = inspect.signature(flair.nn.Classifier.evaluate)
PREDICTED = "predicted"  # the label name flair's evaluate predicts into


def can_shard(model: flair.nn.Model) -> TypeGuard[flair.nn.Classifier]:
    """Whether ``model`` evaluates with flair's base ``Classifier.evaluate``, which this module can split."""
    return isinstance(model, flair.nn.Classifier) and type(model).evaluate is flair.nn.Classifier.evaluate


class _ReplayedPredictions:
    """Stands in for the model inside flair's ``Classifier.evaluate``: ``predict`` adds the labels the ranks
    predicted for the batch (batches come in order) and returns that batch's loss; everything else is the model's."""

    def __init__(self, model: flair.nn.Classifier, batches: list[PredictedBatch]) -> None:
        self._model = model
        self._batches = iter(batches)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def predict(self, sentences: list[DataPoint], *, label_name: str, **kwargs: Any) -> Any:
        batch = next(self._batches)
        for data_point, labels in zip(sentences, batch.labels, strict=True):
            restore_labels(data_point, label_name, labels[PREDICTED])
        return _to_device(batch.returned, flair.device)


class _RetriedInHalves:
    """Stands in for the model inside flair's ``Classifier.evaluate`` in one process: ``predict`` is the model's, and
    a batch that runs out of device memory is predicted again in halves (:func:`predict_in_parts`), as on a rank."""

    def __init__(self, model: flair.nn.Classifier) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def predict(self, sentences: list[DataPoint], *, label_name: str, **kwargs: Any) -> Any:
        return predict_in_parts(self._model, sentences, {"label_name": label_name, **kwargs}, [label_name])


def _evaluate_whole(
    model: flair.nn.Model, data: Dataset, out_path: Path | None, evaluate_kwargs: dict[str, Any]
) -> Result:
    """``model.evaluate`` in this process; with flair's own ``Classifier.evaluate``, out-of-memory batches in halves."""
    if can_shard(model):
        retried = _RetriedInHalves(model)
        return flair.nn.Classifier.evaluate(retried, data, out_path=out_path, **evaluate_kwargs)  # type: ignore[arg-type]
    return model.evaluate(data, out_path=out_path, **evaluate_kwargs)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(item, device) for item in value)
    return value


def _ranks_with_other_data(
    data: Dataset, batches: list[PredictedBatch], mini_batch_size: int, world_size: int
) -> list[int]:
    """The ranks whose batches are not the ones global rank 0 would deal them from its own copy of ``data``."""
    size = _len_dataset(data)
    differing = set()
    for batch in batches:
        indices = range(batch.number * mini_batch_size, min((batch.number + 1) * mini_batch_size, size))
        if batch.fingerprints != [fingerprint(data[index]) for index in indices]:
            differing.add(batch.rank)
    numbers = {batch.number for batch in batches}
    differing.update(number % world_size for number in range(-(-size // mini_batch_size)) if number not in numbers)
    return sorted(differing)


def _evaluate_sharded(
    fabric: Fabric, model: flair.nn.Classifier, data: Dataset, out_path: Path | None, evaluate_kwargs: dict[str, Any]
) -> Result | None:
    """Predict this rank's share; on global rank 0 score everything with flair's evaluate (``None`` elsewhere)."""
    arguments = _FLAIR_EVALUATE.bind(model, data, **evaluate_kwargs)
    arguments.apply_defaults()
    mini_batch_size = arguments.arguments["mini_batch_size"]
    mine = batches_of_rank(_len_dataset(data), mini_batch_size, fabric.global_rank, fabric.world_size)
    storage = arguments.arguments["embedding_storage_mode"]
    # in a terminal only: in a notebook or a log file a bar from a worker process is a stream of lines
    shown = Tqdm.tqdm(
        mine, desc="evaluating: rank 0's batches", unit="batch", disable=not (fabric.is_global_zero and _terminal())
    )
    batches = ((number, list(positions), [data[position] for position in positions]) for number, positions in shown)
    options = {
        "embedding_storage_mode": storage,
        "mini_batch_size": mini_batch_size,
        "label_name": PREDICTED,
        "return_loss": arguments.arguments["return_loss"],
    }
    predicted = predict_batches(
        model, batches, [PREDICTED], options, fabric.global_rank, lambda batch: store_embeddings(batch, storage)
    )
    gathered = gather_batches(fabric, predicted)
    if gathered is None:
        return None
    predictions, unsupported = gathered
    differing = [] if unsupported else _ranks_with_other_data(data, predictions, mini_batch_size, fabric.world_size)
    if unsupported or differing:
        reason = (
            unsupported[0]
            if unsupported
            else (
                f"rank(s) {differing} evaluated other data than global rank 0 (a corpus or a random sample that differs"
                " across processes)"
            )
        )
        log.warning(f"evaluating on global rank 0 only: {reason}.")  # a log line: a warning filter must not kill
        return _evaluate_whole(model, data, out_path, evaluate_kwargs)
    replay = _ReplayedPredictions(model, predictions)
    with _without_progress_bars():  # flair's bar would count the replay, at thousands of batches per second
        return flair.nn.Classifier.evaluate(replay, data, out_path=out_path, **evaluate_kwargs)  # type: ignore[arg-type]


def _terminal() -> bool:
    return sys.stderr.isatty()


_PROGRESS_BAR = re.compile(r"\d+/\d+ \[|\d+it \[")


@contextlib.contextmanager
def _without_progress_bars() -> Iterator[None]:
    """Drop the progress bars written to stderr inside the block; everything else written there passes through."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        kept = [part for part in re.split(r"[\r\n]", captured.getvalue()) if part and not _PROGRESS_BAR.search(part)]
        if kept:
            sys.stderr.write("\n".join(kept) + "\n")


@contextlib.contextmanager
def ready_for_inference(fabric: Fabric, model: flair.nn.Model) -> Iterator[None]:
    """Inside the block ``model`` is on the rank's device, in the run's precision ("-true" precisions convert it;
    mixed ones run under ``fabric.autocast()``) and in eval mode: for ``flair_fabric.predict`` and
    ``flair_fabric.evaluate``. Afterwards its parameters and buffers have their own dtypes again (in one process the
    model is the caller's)."""
    model.to(fabric.device)  # flair.device is the rank's device already (the launch path sets it)
    tensors = [*model.parameters(), *model.buffers()]
    dtypes = [tensor.dtype for tensor in tensors]
    fabric.strategy.precision.convert_module(model)
    model.eval()
    try:
        with fabric.autocast():
            yield
    finally:
        for tensor, dtype in zip(tensors, dtypes, strict=True):
            if tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)


def evaluate_across_ranks(
    fabric: Fabric,
    model: flair.nn.Model,
    data: Dataset,
    *,
    out_path: Path | None,
    embeddings_storage_mode: EmbeddingStorageMode | None = None,
    **evaluate_kwargs: Any,
) -> Result:
    """``model.evaluate(data, out_path=out_path, ...)`` with the prediction split across the ranks of ``fabric``.

    Every rank must call it with the same data. Every rank returns the same :class:`~flair.training_utils.Result`,
    the one flair's ``evaluate`` gives in one process; only global rank 0 writes ``out_path``.
    ``embeddings_storage_mode``, if given, is applied to ``data`` afterwards, as flair's trainer does.
    """
    result: Result | None
    if fabric.world_size == 1:
        result = _evaluate_whole(model, data, out_path, evaluate_kwargs)
    elif can_shard(model):
        result = _evaluate_sharded(fabric, model, data, out_path if fabric.is_global_zero else None, evaluate_kwargs)
    else:
        if fabric.is_global_zero:
            log.warning(
                f"{type(model).__name__} overrides flair's evaluate, which cannot be split across processes:"
                " evaluating on global rank 0 only."
            )
        result = model.evaluate(data, out_path=out_path, **evaluate_kwargs) if fabric.is_global_zero else None
    if embeddings_storage_mode is not None:
        store_embeddings(data, embeddings_storage_mode)
    if fabric.world_size > 1:
        wait_for_global_zero(fabric)  # rank 0 scores (or, in the fallback, evaluates everything) meanwhile
        result = fabric.broadcast(result, src=0)
    assert result is not None
    return result
