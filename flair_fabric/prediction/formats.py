"""Input and output formats of streamed prediction: records read lazily from plain text or CoNLL columns, written as
JSON lines or CoNLL.

A record is one data point of the input with where it came from; a record that cannot be a data point (a blank
line, undecodable bytes, a line longer than ``max_characters``) carries the reason instead, so that the run can say
what it skipped and where, and count that every record came out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from flair.data import Relation, Sentence, Span, Token
from flair.tokenization import Tokenizer

from flair_fabric.prediction import OUTPUT_FORMATS
from flair_fabric.storage import open_input

MAX_CHARACTERS = 100_000


@dataclass
class Record:
    """One data point of the input (``sentence``), or why its lines were skipped (``problem``)."""

    line: int  # 1-based number of its first line
    sentence: Sentence | None = None
    problem: str | None = None
    columns: list[list[str]] = field(default_factory=list)  # CoNLL input: the lines' columns, for CoNLL output


def check_format(name: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; otherwise a clear error naming the argument."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not a format this reads/writes: choose one of {', '.join(choices)}.")
    return value


def output_format_for(path: Path, output_format: str | None) -> str:
    """The output format: as given, else from the file's suffix (``.conll``/``.tsv`` columns, JSON lines otherwise)."""
    if output_format is not None:
        return check_format("output_format", output_format, OUTPUT_FORMATS)
    return "conll" if path.suffix in (".conll", ".tsv") else "jsonl"


def _decoded_lines(path: str | Path, options: Mapping[str, Any] | None) -> Iterator[tuple[int, str | None]]:
    with open_input(path, options) as stream:  # a URL's file is streamed from the store
        for number, raw in enumerate(stream, start=1):
            try:
                yield number, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                yield number, None


def read_text(
    path: str | Path,
    tokenizer: Tokenizer | bool,
    max_characters: int = MAX_CHARACTERS,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[Record]:
    """One sentence per line, tokenized as flair's ``Sentence(text, use_tokenizer=tokenizer)`` does."""
    for number, line in _decoded_lines(path, storage_options):
        if line is None:
            yield Record(number, problem="not UTF-8")
        elif not line.strip():
            yield Record(number, problem="blank line")
        elif len(line) > max_characters:
            yield Record(number, problem=f"longer than {max_characters} characters")
        else:
            yield Record(number, Sentence(line, use_tokenizer=tokenizer))


def read_conll(
    path: str | Path, max_characters: int = MAX_CHARACTERS, storage_options: Mapping[str, Any] | None = None
) -> Iterator[Record]:
    """CoNLL columns (token first, whitespace or tab separated), sentences separated by blank lines; ``#`` comments
    are skipped."""
    block: list[list[str]] = []
    start, problem = 0, None
    for number, line in _decoded_lines(path, storage_options):
        if line is not None and not line.strip():
            if block or problem:
                yield _conll_record(start, block, problem, max_characters)
            block, problem = [], None
            continue
        if not block and problem is None:
            start = number
        if line is None:
            problem = problem or f"line {number} is not UTF-8"
        elif not line.startswith("# "):
            block.append(line.split("\t") if "\t" in line else line.split())
    if block or problem:
        yield _conll_record(start, block, problem, max_characters)


def _conll_record(start: int, block: list[list[str]], problem: str | None, max_characters: int) -> Record:
    if problem is not None:
        return Record(start, problem=problem)
    if sum(len(columns[0]) + 1 for columns in block) > max_characters:
        return Record(start, problem=f"longer than {max_characters} characters")
    return Record(start, Sentence([columns[0] for columns in block]), columns=block)


def _where(label_owner: Any) -> dict[str, Any]:
    if isinstance(label_owner, Span):
        return {"start": label_owner.tokens[0].idx - 1, "end": label_owner.tokens[-1].idx, "text": label_owner.text}
    if isinstance(label_owner, Token):
        return {"token": label_owner.idx - 1, "text": label_owner.text}
    if isinstance(label_owner, Relation):
        return {"head": _where(label_owner.first), "tail": _where(label_owner.second)}
    return {}


def write_jsonl(stream: IO[str], record: Record, label_names: list[str]) -> None:
    """One JSON object per data point: its line, text, tokens and labels (type, value, score, where)."""
    sentence = record.sentence
    assert sentence is not None
    labels = [
        {"type": name, "value": label.value, "score": label.score, **_where(label.data_point)}
        for name in label_names
        for label in sentence.get_labels(name)
    ]
    row = {"line": record.line, "text": sentence.to_original_text(), "tokens": [t.text for t in sentence]}
    stream.write(json.dumps({**row, "labels": labels}, ensure_ascii=False) + "\n")


def _tags(sentence: Sentence, label_name: str, stream: IO[str]) -> list[str]:
    tags = ["O"] * len(sentence)
    for label in sentence.get_labels(label_name):
        owner = label.data_point
        if owner is sentence:
            stream.write(f"# {label_name} = {label.value} ({label.score:.4f})\n")
        elif isinstance(owner, Span):
            first, last = owner.tokens[0].idx - 1, owner.tokens[-1].idx
            tags[first:last] = [f"B-{label.value}"] + [f"I-{label.value}"] * (last - first - 1)
        elif isinstance(owner, Token):
            tags[owner.idx - 1] = label.value
    return tags


def write_conll(stream: IO[str], record: Record, label_names: list[str]) -> None:
    """The input's columns (or the token) plus a predicted tag column per label name: BIO for spans, the value for
    token labels, ``O`` for none; sentence-level labels as ``# name = value (score)`` lines first."""
    sentence = record.sentence
    assert sentence is not None
    columns = record.columns or [[token.text] for token in sentence]
    tag_columns = [_tags(sentence, name, stream) for name in label_names]
    for index, token_columns in enumerate(columns):
        stream.write("\t".join([*token_columns, *(tags[index] for tags in tag_columns)]) + "\n")
    stream.write("\n")


WRITERS = {"jsonl": write_jsonl, "conll": write_conll}
