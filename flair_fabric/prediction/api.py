"""``flair_fabric.predict``: a trained flair model's ``predict`` split across processes started (or found) by Fabric
exactly as for training; in memory (labels land on the caller's data points) or streamed from a file to a file."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, ClassVar, cast

import flair
import torch
from flair.data import DataPoint
from flair.file_utils import Tqdm
from lightning.fabric import Fabric

from flair_fabric.evaluation.predictions import RecordedLabel
from flair_fabric.evaluation.sharded import ready_for_inference
from flair_fabric.launch.arguments import LightningArguments, takes_lightning_arguments
from flair_fabric.launch.config import make_launch_config
from flair_fabric.launch.runner import Job, run_job
from flair_fabric.prediction import INPUT_FORMATS
from flair_fabric.prediction.formats import (
    WRITERS,
    Record,
    check_format,
    output_format_for,
    read_conll,
    read_text,
)
from flair_fabric.prediction.sharding import (
    NotSplittable,
    Predicted,
    label_names_of,
    predict_across_ranks,
    put_labels,
)
from flair_fabric.storage import check_reachable, is_url, write_atomically

log = logging.getLogger("flair")


@dataclass
class PredictionSummary:
    """What a streamed prediction did: records read, predicted and skipped (line number, reason), and its time."""

    read: int = 0
    predicted: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def per_second(self) -> float:
        """Data points predicted per second."""
        return self.predicted / self.seconds if self.seconds > 0 else 0.0


@dataclass
class NotSplit:
    """What every rank returns when the model's labels cannot be moved between processes: why."""

    reason: str


@dataclass
class _Stream:
    path: str | Path  # a local path, or a URL (flair_fabric.storage)
    input_format: str
    out_path: str | Path
    output_format: str
    tokenizer: Any
    chunk_size: int
    progress_bar: bool
    storage_options: Mapping[str, Any] | None = None


class PredictionJob(Job):
    """A model's ``predict`` with the batches dealt to the ranks, in memory or streamed from a file to a file; after
    workers, the caller's data points get rank 0's labels."""

    result_types: ClassVar[tuple[type, ...]] = (PredictionSummary, Predicted, RecordedLabel, NotSplit)

    def __init__(self, model: flair.nn.Model, data: Sequence[DataPoint] | _Stream, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.data, self.predict_kwargs = model, data, kwargs
        self.in_workers = False  # the ranks are workers: rank 0's labels come back for the caller's data points

    def for_workers(self) -> Job:
        copy = PredictionJob(self.model, self.data, self.predict_kwargs)
        copy.in_workers = True
        return copy

    def run_on_rank(self, fabric: Fabric) -> Any:
        self.position.at("the sharded prediction")
        with ready_for_inference(fabric, self.model):
            if isinstance(self.data, _Stream):
                return _predict_stream(fabric, self.model, self.data, self.predict_kwargs)
            try:
                predicted = predict_across_ranks(
                    fabric, self.model, self.data, self.predict_kwargs, label_on_global_zero=not self.in_workers
                )
            except NotSplittable as error:
                return NotSplit(str(error))  # the caller (each rank of a script) predicts its data points itself
        if self.in_workers and predicted is not None:  # to the caller through a file: JSON reads back fastest
            return predicted.to_json() or predicted
        if fabric.world_size > 1 and not self.in_workers:  # every rank of the script gets the labels on its data
            predicted = fabric.broadcast(predicted, src=0)
            if not fabric.is_global_zero:
                _put_labels(self.data, predicted)
        return predicted

    def hand_back(self, result: Any) -> Any:
        if isinstance(result, str):
            result = Predicted.from_json(result)
        if isinstance(result, Predicted) and not isinstance(self.data, _Stream):  # workers predicted copies
            _put_labels(self.data, result)
        return result


def _put_labels(data: Sequence[DataPoint], predicted: Predicted | None) -> None:
    assert predicted is not None
    for data_point, labels in zip(data, predicted.labels, strict=True):
        put_labels(data_point, labels)


def _records(stream: _Stream) -> Iterator[Record]:
    if stream.input_format == "conll":
        return read_conll(stream.path, storage_options=stream.storage_options)
    return read_text(stream.path, stream.tokenizer, storage_options=stream.storage_options)


def _predict_stream(fabric: Fabric, model: flair.nn.Model, stream: _Stream, kwargs: dict[str, Any]) -> Any:
    """Every rank reads the same chunk of records and predicts its share; global rank 0 writes them in input order
    to a local temporary file, renamed to ``out_path`` (uploaded whole to a URL) when every record is accounted for."""
    summary, started = PredictionSummary(), time.time()
    names = label_names_of(model, kwargs.get("label_name"))
    write = WRITERS[stream.output_format]
    records = _records(stream)
    bar = Tqdm.tqdm(desc="predicting", unit=" data points", disable=not (fabric.is_global_zero and stream.progress_bar))

    def predict_all(target: str) -> None:
        with open(target, "w", encoding="utf-8") if fabric.is_global_zero else open(os.devnull, "w") as output:
            while chunk := list(islice(records, stream.chunk_size)):
                sentences = [record.sentence for record in chunk if record.sentence is not None]
                try:
                    predict_across_ranks(fabric, model, sentences, kwargs)
                except NotSplittable as error:
                    raise NotSplittable(
                        f"{error}; a file cannot be predicted with this model: pass data points"
                    ) from None
                summary.read += len(chunk)
                summary.predicted += len(sentences)
                summary.skipped += [(record.line, record.problem) for record in chunk if record.problem is not None]
                for record in chunk:
                    if record.sentence is not None:
                        write(output, record, names)
                bar.update(len(sentences))  # every rank read the whole chunk: the count is global
        if summary.read != summary.predicted + len(summary.skipped):
            raise RuntimeError(f"{summary.read} records read, {summary.predicted} predicted, {summary.skipped} skipped")

    if fabric.is_global_zero:
        write_atomically(stream.out_path, predict_all, stream.storage_options)
    else:
        predict_all(os.devnull)
    bar.close()
    summary.seconds = time.time() - started
    if fabric.is_global_zero:
        _report(summary, stream)
    return summary


def _report(summary: PredictionSummary, stream: _Stream) -> None:
    log.info(
        f"predicted {summary.predicted} data point(s) of {stream.path} in {summary.seconds:.1f} s"
        f" ({summary.per_second:.1f}/s) into {stream.out_path}"
    )
    for line, problem in summary.skipped[:20]:
        log.warning(f"{stream.path}:{line}: skipped ({problem})")
    if len(summary.skipped) > 20:
        log.warning(f"... {len(summary.skipped) - 20} more skipped; all of them in the returned summary")


@takes_lightning_arguments
def predict(
    model: flair.nn.Model,
    data: DataPoint | Sequence[DataPoint] | str | Path,
    *,
    out_path: str | Path | None = None,
    input_format: str = "text",
    output_format: str | None = None,
    tokenizer: Any = True,
    chunk_size: int | None = None,
    progress_bar: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    mini_batch_size: int = 32,
    return_probabilities_for_all_classes: bool = False,
    verbose: bool = False,
    label_name: str | None = None,
    return_loss: bool = False,
    embedding_storage_mode: str = "none",
    **lightning: Any,
) -> Any:
    """``model.predict`` with the batches split across processes.

    ``data``: data points (a list, or one), whose labels then equal those of flair's ``predict`` in one process, also
    when the processes are spawned or forked workers; returns them as flair does. Or a file path: read in chunks of
    ``chunk_size`` records (``input_format`` ``"text"``, one sentence per line tokenized with ``tokenizer`` as
    flair's ``Sentence`` does, or ``"conll"``), written in input order to ``out_path`` (``output_format``
    ``"jsonl"`` or ``"conll"``, by default from its suffix) by global rank 0; returns a :class:`PredictionSummary`.
    A streamed run shows a progress bar (global data points, and per second) on global rank 0: ``progress_bar=None``
    when standard error is a terminal, ``True`` always, ``False`` never.
    ``data`` and ``out_path`` may be fsspec URLs (``s3://bucket/in.txt``; docs/storage.md): the input is streamed
    from the store, the output uploaded whole; ``storage_options`` passes the filesystem's options (credentials,
    endpoint) where the environment does not.
    Takes flair's ``predict`` arguments plus Lightning's, which start processes as
    :class:`~flair_fabric.FabricTrainer` does. A model that puts labels where they cannot be moved between processes
    (none of flair's own) is predicted by flair's ``predict`` in the calling process (on every rank of a script),
    with a warning.
    """
    if not hasattr(model, "predict"):
        raise ValueError(f"model: a {type(model).__name__} has no predict method; pass a trained flair model.")
    config = make_launch_config(**LightningArguments(**lightning).as_dict())
    kwargs = {
        "mini_batch_size": mini_batch_size,
        "return_probabilities_for_all_classes": return_probabilities_for_all_classes,
        "verbose": verbose,
        "label_name": label_name,
        "return_loss": return_loss,
        "embedding_storage_mode": embedding_storage_mode,
    }
    if isinstance(data, str | Path):
        shows_bar = os.isatty(2) if progress_bar is None else progress_bar
        stream = _checked_stream(
            data if is_url(data) else Path(data),
            input_format,
            out_path,
            output_format,
            tokenizer,
            chunk_size,
            config,
            shows_bar,
            storage_options,
        )
        return run_job(PredictionJob(model, stream, kwargs), config)
    data_points = [data] if isinstance(data, DataPoint) else list(data)
    predicted = run_job(PredictionJob(model, data_points, kwargs), config)
    if isinstance(predicted, NotSplit):  # as flair_fabric.evaluate: not split, never wrong
        log.warning(f"predicting in this process only: {predicted.reason}")
        return cast(Any, model).predict(data_points, **kwargs)
    if return_loss and data_points:  # as flair's predict: the summed loss and the number of labels
        loss_sum, count = predicted.loss
        return torch.tensor(loss_sum, device=flair.device), count
    return data


def _check_local_input(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"data={str(path)!r} is not a file: pass an existing input file (or a list of data points).")
    if path.stat().st_size == 0:
        raise ValueError(f"data={str(path)!r} is empty: there is nothing to predict.")


def _check_local_output(out: Path, out_path: str | Path) -> None:
    if not out.parent.is_dir():
        raise ValueError(f"out_path={str(out_path)!r}: its folder does not exist; create it first.")


def _checked_stream(
    path: str | Path,
    input_format: str,
    out_path: str | Path | None,
    output_format: str | None,
    tokenizer: Any,
    chunk_size: int | None,
    config: Any,
    progress_bar: bool,
    storage_options: Mapping[str, Any] | None = None,
) -> _Stream:
    if isinstance(path, Path):
        _check_local_input(path)
    elif check_reachable(path, argument="data", storage_options=storage_options)["size"] == 0:
        raise ValueError(f"data={path!r} is empty: there is nothing to predict.")
    check_format("input_format", input_format, INPUT_FORMATS)
    if out_path is None:
        raise ValueError("out_path is needed when data is a file: pass the file the predictions are written to.")
    out = Path(out_path)
    if is_url(out_path):  # the bucket (or folder) the output is uploaded into
        check_reachable(str(out_path), argument="out_path", storage_options=storage_options, expect="folder")
    else:
        _check_local_output(out, out_path)
    size = chunk_size if chunk_size is not None else 64 * config.world_size * 32
    if size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} is not valid: pass a positive whole number.")
    target = str(out_path) if is_url(out_path) else out
    format_out = output_format_for(out, output_format)
    return _Stream(path, input_format, target, format_out, tokenizer, size, progress_bar, storage_options)
