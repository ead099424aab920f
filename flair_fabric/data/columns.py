"""The stored columns of a data point, and the conversion of flair data points to rows and back.

A row holds a sentence's tokens (text, whitespace after, start position, head id), its start position, language code,
document-boundary flag and metadata, and its labels in flair's order (``annotation_layers``): each label with its type,
its target (the data point itself, a token or a span of tokens), value and score. A ``DataPair`` of two sentences
stores both sentences (``first.*``, ``second.*``) and the pair's own labels. Nothing else is stored: embeddings,
predicted probability distributions and relations are not.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from flair.data import DataPair, DataPoint, Sentence, Span, Token

from flair_fabric.data.errors import UnsupportedDataPointError

FORMAT_VERSION = "1"
"""The version of the stored layout; a cache written by another version is rebuilt, never read."""

SENTENCE, PAIR = "sentence", "pair"
ITSELF, TOKEN, SPAN = 0, 1, 2
SUPPORTED = (
    "flair Sentences and DataPairs of two Sentences, with labels on the data point itself, on its tokens and on "
    "spans of its tokens"
)

LABEL = pa.struct(
    [
        ("type", pa.string()),
        ("target", pa.int8()),
        ("start", pa.int32()),
        ("end", pa.int32()),
        ("value", pa.string()),
        ("score", pa.float64()),
    ]
)
SENTENCE_FIELDS = [
    ("tokens", pa.list_(pa.string())),
    ("whitespace_after", pa.list_(pa.int32())),
    ("token_starts", pa.list_(pa.int64())),
    ("head_ids", pa.list_(pa.int64())),
    ("start_position", pa.int64()),
    ("language_code", pa.string()),
    ("document_boundary", pa.bool_()),
    ("metadata", pa.string()),
    ("labels", pa.list_(LABEL)),
    ("n_tokens", pa.int32()),
]


def parts(kind: str) -> list[str]:
    """The column prefixes of the sentences of a data point of ``kind``."""
    return [""] if kind == SENTENCE else ["first.", "second."]


def schema(kind: str) -> pa.Schema:
    """The Arrow schema of a split of ``kind`` (``"sentence"`` or ``"pair"``), with the format version."""
    fields = [(prefix + name, type_) for prefix in parts(kind) for name, type_ in SENTENCE_FIELDS]
    if kind == PAIR:
        fields.append(("pair_labels", pa.list_(LABEL)))
    return pa.schema(fields, metadata={"flair_fabric_format": FORMAT_VERSION, "kind": kind})


def kind_of(data_point: object) -> str:
    """``"sentence"`` or ``"pair"``; anything else is refused, naming what is supported."""
    if isinstance(data_point, Sentence):
        return SENTENCE
    if type(data_point) is DataPair and all(
        isinstance(part, Sentence) for part in (data_point.first, data_point.second)
    ):
        return PAIR
    raise UnsupportedDataPointError(f"cannot store a {type(data_point).__name__}: supported are {SUPPORTED}")


def _label_row(label: Any, typename: str, owner: DataPoint, sentence: Sentence | None) -> dict[str, Any]:
    if label.metadata:
        raise UnsupportedDataPointError(
            f"cannot store label metadata ({typename}={label.value}): supported are {SUPPORTED}"
        )
    point = label.data_point
    if point is owner:
        target, start, end = ITSELF, 0, 0
    elif sentence is not None and isinstance(point, Token) and point.sentence is sentence:
        target, start, end = TOKEN, point.idx - 1, point.idx
    elif sentence is not None and isinstance(point, Span) and type(point) is Span and point.sentence is sentence:
        target, start, end = SPAN, point.tokens[0].idx - 1, point.tokens[-1].idx
    else:
        raise UnsupportedDataPointError(
            f"cannot store a label ({typename}) on a {type(point).__name__}: supported are {SUPPORTED}"
        )
    return {"type": typename, "target": target, "start": start, "end": end, "value": label.value, "score": label.score}


def _labels(owner: DataPoint, sentence: Sentence | None) -> list[dict[str, Any]]:
    return [
        _label_row(label, typename, owner, sentence)
        for typename, labels in owner.annotation_layers.items()
        for label in labels
    ]


def _metadata(sentence: Sentence) -> str | None:
    metadata = sentence._metadata
    if not metadata:
        return None
    for key, value in metadata.items():
        if not isinstance(value, (str, int, float, bool)) or value is None:
            raise UnsupportedDataPointError(
                f"cannot store the metadata {key}={value!r} ({type(value).__name__}): strings and numbers are supported"
            )
    return json.dumps(metadata, ensure_ascii=False)


def _sentence_row(sentence: Sentence, prefix: str) -> dict[str, Any]:
    tokens = sentence.tokens
    row = {
        "tokens": [token.text for token in tokens],
        "whitespace_after": [token.whitespace_after for token in tokens],
        "token_starts": [token.start_position for token in tokens],
        "head_ids": [token.head_id for token in tokens],
        "start_position": sentence.start_position,
        "language_code": sentence.language_code,
        "document_boundary": bool(sentence.is_document_boundary),
        "metadata": _metadata(sentence),
        "labels": _labels(sentence, sentence),
        "n_tokens": len(tokens),
    }
    return {prefix + name: value for name, value in row.items()}


def encode(data_point: DataPoint, kind: str) -> dict[str, Any]:
    """The row of a data point of ``kind`` (see :func:`kind_of`)."""
    if kind_of(data_point) != kind:
        raise UnsupportedDataPointError(
            f"a split holds one kind of data point: {type(data_point).__name__} in a {kind} split"
        )
    if kind == SENTENCE:
        assert isinstance(data_point, Sentence)
        return _sentence_row(data_point, "")
    assert isinstance(data_point, DataPair)
    if data_point._metadata:
        raise UnsupportedDataPointError(f"cannot store a DataPair's metadata: supported are {SUPPORTED}")
    return {
        **_sentence_row(data_point.first, "first."),
        **_sentence_row(data_point.second, "second."),
        "pair_labels": _labels(data_point, None),
    }


def _add_labels(owner: DataPoint, sentence: Sentence | None, labels: list[dict[str, Any]]) -> None:
    for label in labels:
        target = label["target"]
        if target == ITSELF:
            owner.add_label(label["type"], label["value"], label["score"])
        elif target == TOKEN:
            assert sentence is not None
            sentence[label["start"]].add_label(label["type"], label["value"], label["score"])
        else:
            assert sentence is not None
            sentence[label["start"] : label["end"]].add_label(label["type"], label["value"], label["score"])


def _sentence(row: dict[str, Any], prefix: str) -> Sentence:
    texts, whitespace, starts, heads = (
        row[prefix + name] for name in ("tokens", "whitespace_after", "token_starts", "head_ids")
    )
    tokens = [
        Token(text, head_id=head, whitespace_after=after, start_position=start)
        for text, after, start, head in zip(texts, whitespace, starts, heads, strict=False)
    ]
    sentence = Sentence(
        tokens, language_code=row[prefix + "language_code"], start_position=row[prefix + "start_position"]
    )
    # flair's constructor rewrites the last token's whitespace (and may move start positions): stored values win
    for token, after, start in zip(sentence.tokens, whitespace, starts, strict=False):
        token.whitespace_after, token.start_position = after, start
    sentence.is_document_boundary = row[prefix + "document_boundary"]
    if row[prefix + "metadata"] is not None:
        for key, value in json.loads(row[prefix + "metadata"]).items():
            sentence.add_metadata(key, value)
    _add_labels(sentence, sentence, row[prefix + "labels"])
    return sentence


def decode(row: dict[str, Any], kind: str) -> Sentence | DataPair:
    """The flair data point of a stored row (the inverse of :func:`encode`)."""
    if kind == SENTENCE:
        return _sentence(row, "")
    pair: DataPair = DataPair(_sentence(row, "first."), _sentence(row, "second."))
    _add_labels(pair, None, row["pair_labels"])
    return pair
