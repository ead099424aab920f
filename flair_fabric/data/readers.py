"""Source files read one data point at a time with flair's own parsing (``ColumnDataset``,
``ClassificationDataset``, ``CSVClassificationDataset``), so that a split of any size is stored without holding it.

Each reader gives the data points flair's in-memory reader gives for the same file and options, in the same order.
A line flair cannot read (bytes that are not text in the file's encoding, a line without the token column, a CSV row
without the label columns) raises :class:`~flair_fabric.data.errors.MalformedLineError` naming file and line.
"""

from __future__ import annotations

import contextlib
import csv
import io
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from flair.data import DataPair, Sentence
from flair.datasets import ClassificationDataset, ColumnDataset, CSVClassificationDataset

from flair_fabric.data.errors import MalformedLineError
from flair_fabric.storage import is_url, open_input

Options = Mapping[str, Any] | None
"""A URL's filesystem options (``storage_options``)."""


@contextlib.contextmanager
def _open_text(path: str | Path, encoding: str, storage_options: Options = None) -> Iterator[IO[str]]:
    """A source file opened as text, as ``open(path, encoding=encoding)`` opens it; a URL streamed from the store."""
    if not is_url(path):
        with open(path, encoding=encoding) as file:
            yield file
        return
    with open_input(path, storage_options) as stream, io.TextIOWrapper(stream, encoding=encoding) as file:
        yield file


def _undecodable_line(path: str | Path, encoding: str, storage_options: Options = None) -> MalformedLineError:
    """The first line of ``path`` that is not text in ``encoding``."""
    with open_input(path, storage_options) as file:
        for number, line in enumerate(file, start=1):
            try:
                line.decode(encoding)
            except UnicodeDecodeError as error:
                return MalformedLineError(path, number, f"text in {encoding} ({error.reason} at byte {error.start})")
    return MalformedLineError(path, 0, f"text in {encoding}")


class _Recorded:
    """A text file whose ``readline`` keeps every line it handed out."""

    def __init__(self, file: IO[str]) -> None:
        self.file, self.lines = file, list[str]()

    def readline(self) -> str:
        line = self.file.readline()
        self.lines.append(line)
        return line


@contextlib.contextmanager
def _probe_file(dataset: ColumnDataset, path: str | Path, options: dict[str, Any], storage_options: Options) -> Any:
    """For a URL, a temporary local file of the source's head: the lines flair's span-column probe reads (the first
    line where skipped, then its first 5 sentences), for flair's own ``_identify_span_columns``, which opens a path."""
    if not is_url(path):
        yield path
        return
    with _open_text(path, options["encoding"], storage_options) as text:
        head = _Recorded(text)
        if options["skip_first_line"]:
            head.readline()
        for _ in range(5):
            if not dataset._read_next_sentence(head):
                break
    with tempfile.TemporaryDirectory(prefix="flair-fabric-head-") as folder:
        probe = Path(folder) / "head.txt"
        probe.write_text("".join(head.lines), encoding=options["encoding"])
        yield probe


class _NumberedLines:
    """A text file whose ``readline`` remembers the numbers of the lines it handed out since the last ``clear``."""

    def __init__(self, file: IO[str]) -> None:
        self.file, self.number = file, 0
        self.numbers: list[int] = []

    def readline(self) -> str:
        line = self.file.readline()
        if line:
            self.number += 1
            if not line.isspace():
                self.numbers.append(self.number)
        return line

    def clear(self) -> None:
        self.numbers.clear()


def _column_dataset(path: str | Path, column_format: dict[int, str], options: dict[str, Any]) -> ColumnDataset:
    """A flair ``ColumnDataset`` set up as its constructor sets it up, without reading the file into memory."""
    dataset = ColumnDataset.__new__(ColumnDataset)
    dataset.path_to_column_file = path  # type: ignore[assignment]
    dataset.column_delimiter = re.compile(options["column_delimiter"])
    for name in (
        "comment_symbol",
        "document_separator_token",
        "every_sentence_is_independent",
        "label_name_map",
        "banned_sentences",
        "default_whitespace_after",
        "documents_as_sentences",
        "encoding",
    ):
        setattr(dataset, name, options[name])
    dataset.in_memory, dataset.total_sentence_count = True, 0
    dataset.text_column, dataset.head_id_column = 0, None
    for column, name in column_format.items():
        if name == "text":
            dataset.text_column = column
        if name in ColumnDataset.HEAD:
            dataset.head_id_column = column
    return dataset


def _check_line(dataset: ColumnDataset, path: str | Path, number: int, line: str) -> None:
    if dataset.comment_symbol is not None and line.startswith(dataset.comment_symbol):
        return
    fields = dataset.column_delimiter.split(line.rstrip())
    needed = max(dataset.text_column, dataset.head_id_column or 0) + 1
    if len(fields) < needed:
        raise MalformedLineError(
            path,
            number,
            f"at least {needed} columns separated by {dataset.column_delimiter.pattern!r}, found {len(fields)}",
        )
    if dataset.head_id_column and not re.fullmatch(r"[+-]?\d+", fields[dataset.head_id_column].strip()):
        raise MalformedLineError(path, number, f"an integer head id in column {dataset.head_id_column}")


def read_column_file(
    path: str | Path, column_format: dict[int, str], options: dict[str, Any], storage_options: Options = None
) -> Iterator[Sentence]:
    """The sentences of one column file (a path or URL), as flair's ``ColumnDataset(path, column_format, **options)``
    reads them."""
    dataset = _column_dataset(path, column_format, options)
    try:
        with _probe_file(dataset, path, options, storage_options) as probe:
            dataset.path_to_column_file = probe
            dataset._identify_span_columns(column_format, options["skip_first_line"])
    except UnicodeDecodeError:
        raise _undecodable_line(path, options["encoding"], storage_options) from None
    except (IndexError, ValueError):
        _check_whole_file(dataset, path, options, storage_options)
        raise
    dataset.path_to_column_file = path  # type: ignore[assignment]
    with _open_text(path, options["encoding"], storage_options) as text:
        file = _NumberedLines(text)
        if options["skip_first_line"]:
            file.readline()
        while True:
            file.clear()
            try:
                lines = dataset._read_next_sentence(file)
            except UnicodeDecodeError:
                raise _undecodable_line(path, options["encoding"], storage_options) from None
            if not lines:
                return
            for number, line in zip(file.numbers, lines, strict=False):
                _check_line(dataset, path, number, line)
            sentence = dataset._convert_lines_to_sentence(
                lines,
                word_level_tag_columns=dataset.word_level_tag_columns,
                span_level_tag_columns=dataset.span_level_tag_columns,
            )
            if not sentence:
                continue
            banned = dataset.banned_sentences
            if banned is not None and any(text in sentence.to_plain_string() for text in banned):
                continue
            yield sentence


def _check_whole_file(
    dataset: ColumnDataset, path: str | Path, options: dict[str, Any], storage_options: Options = None
) -> None:
    with _open_text(path, options["encoding"], storage_options) as file:
        for number, line in enumerate(file, start=1):
            if not line.isspace() and not (number == 1 and options["skip_first_line"]):
                _check_line(dataset, path, number, line)


def read_classification_file(
    path: str | Path, options: dict[str, Any], storage_options: Options = None
) -> Iterator[Sentence]:
    """The sentences of one FastText file (``__label__`` prefixes), as flair's ``ClassificationDataset`` gives them
    (``memory_mode`` ``"partial"``, flair's default, or ``"full"``, which drops sentences without tokens)."""
    dataset = ClassificationDataset.__new__(ClassificationDataset)
    for name in ("label_type", "truncate_to_max_chars", "truncate_to_max_tokens", "label_name_map"):
        setattr(dataset, name, options[name])
    dataset.allow_examples_without_labels = allowed = options["allow_examples_without_labels"]
    prefix, tokenizer, skip_labels = "__label__", options["tokenizer"], options["skip_labels"]
    longest = options["filter_if_longer_than"]
    with _open_text(path, options["encoding"], storage_options) as file:
        try:
            for line in file:
                if (prefix not in line and not allowed) or (" " not in line and "\t" not in line):
                    continue
                if 0 < longest < len(line.split(" ")):
                    continue
                if skip_labels and any(prefix + label in line for label in skip_labels):
                    continue
                words, label_length, labelled = line.split(), 0, False
                for word in words:
                    if not word.startswith(prefix):
                        break
                    label_length, labelled = label_length + len(word) + 1, True
                if not (line[label_length:].strip() and (labelled or allowed)):
                    continue
                sentence = dataset._parse_line_to_sentence(line, prefix, tokenizer)
                if options["memory_mode"] == "full" and (sentence is None or len(sentence.tokens) == 0):
                    continue
                yield sentence
        except UnicodeDecodeError:
            raise _undecodable_line(path, options["encoding"], storage_options) from None


def read_csv_file(
    path: str | Path, column_name_map: dict[int, str], options: dict[str, Any], storage_options: Options = None
) -> Iterator[Sentence | DataPair]:
    """The data points of one CSV file (sentences, or ``DataPair``s where ``column_name_map`` names ``"pair"``
    columns), as flair's ``CSVClassificationDataset`` gives them."""
    dataset = CSVClassificationDataset.__new__(CSVClassificationDataset)
    dataset.column_name_map = column_name_map
    for name in ("label_type", "tokenizer", "max_tokens_per_doc", "max_chars_per_doc", "no_class_label"):
        setattr(dataset, name, options[name])
    dataset.text_columns = [column for column, name in column_name_map.items() if name == "text"]
    dataset.pair_columns = [column for column, name in column_name_map.items() if name == "pair"]
    labelled = any(name.startswith("label") for name in column_name_map.values())
    needed = max(column_name_map) + 1
    with _open_text(path, options["encoding"], storage_options) as file:
        reader = csv.reader(file, **options["fmtparams"])
        try:
            if options["skip_header"]:
                next(reader, None)
            for row in reader:
                if any(column >= len(row) for column in dataset.text_columns):
                    continue
                if labelled and len(row) < needed:
                    raise MalformedLineError(path, reader.line_num, f"{needed} columns, found {len(row)}")
                if not any(name.startswith("label") and row[column] for column, name in column_name_map.items()):
                    continue
                yield dataset._make_labeled_data_point(row)
        except UnicodeDecodeError:
            raise _undecodable_line(path, options["encoding"], storage_options) from None
