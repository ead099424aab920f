"""Move a model's predicted labels from the process that predicted them to another process's copy of the data.

A label is recorded by its value, score and metadata plus the *address* of what it labels inside the data point: the
data point itself (a sentence's class), a token, a span or a relation between two spans, each by token positions.
On the receiving side the address is resolved in that process's own copy of the same data point and the label is
added there, in the recorded order, exactly as the model's ``predict`` would have added it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flair.data import DataPoint, Relation, Sentence, Span, Token

Address = tuple[Any, ...]


class UnsupportedPrediction(TypeError):
    """A predicted label on something this module cannot address (neither the data point nor a part of a sentence)."""


@dataclass(frozen=True)
class RecordedLabel:
    """One predicted label, detached from the objects of the process that predicted it."""

    address: Address
    value: str
    score: float
    metadata: dict[str, Any] = field(default_factory=dict)


def _address(data_point: DataPoint, part: DataPoint) -> Address:
    if part is data_point:
        return ("self",)
    if isinstance(data_point, Sentence) and getattr(part, "sentence", None) is data_point:
        if isinstance(part, Token):
            return ("token", part.idx - 1)
        if isinstance(part, Span):
            return ("span", part.tokens[0].idx - 1, part.tokens[-1].idx)
        if isinstance(part, Relation):
            return ("relation", _address(data_point, part.first), _address(data_point, part.second))
    raise UnsupportedPrediction(
        f"a predicted label on a {type(part).__name__} inside a {type(data_point).__name__} cannot be moved between"
        " processes"
    )


def _resolve(data_point: DataPoint, address: Address) -> DataPoint:
    kind = address[0]
    if kind == "self":
        return data_point
    assert isinstance(data_point, Sentence)
    if kind == "token":
        return data_point[address[1]]
    if kind == "span":
        return data_point[address[1] : address[2]]
    first, second = _resolve(data_point, address[1]), _resolve(data_point, address[2])
    assert isinstance(first, Span) and isinstance(second, Span)
    return Relation(first, second)


def record_labels(data_point: DataPoint, label_type: str) -> list[RecordedLabel]:
    """The ``label_type`` labels of ``data_point`` (and of its tokens, spans and relations), in flair's order."""
    return [
        RecordedLabel(_address(data_point, label.data_point), label.value, label.score, dict(label.metadata))
        for label in data_point.get_labels(label_type)
    ]


def restore_labels(data_point: DataPoint, label_type: str, labels: list[RecordedLabel]) -> None:
    """Add recorded labels to this process's copy of ``data_point``, in the order they were recorded."""
    for label in labels:
        _resolve(data_point, label.address).add_label(label_type, label.value, label.score, **label.metadata)
