"""Every data point of a mapped corpus equals the one flair's own reader gives for the same files and arguments
(the independent reference): tokens, whitespace, token, span and sentence labels, document boundaries, metadata,
neighbours; on the bundled WNUT-16 and TREC data and on small files with the formats' edge cases."""

from __future__ import annotations

import inspect
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flair.data import Corpus, DataPair, Sentence
from flair.datasets import (
    ClassificationCorpus,
    ColumnCorpus,
    ColumnDataset,
    CSVClassificationCorpus,
    FlairDatapointDataset,
)
from flair.tokenization import SpaceTokenizer

from flair_fabric.data import MappedCorpus, map_corpus
from flair_fabric.datasets import TREC_FILE, trec_corpus, wnut16_corpus
from flair_fabric.training.balancing import data_point_length

from .reference import COLUMN_FORMAT, COLUMNS, CSV, FASTTEXT, describe_split, write


def _same_splits(mapped, reference) -> None:
    for name in ("train", "dev", "test"):
        ours, theirs = getattr(mapped, name), getattr(reference, name)
        assert (ours is None) == (theirs is None), name
        if theirs is not None:
            assert describe_split(ours) == describe_split(theirs), name
            assert list(ours.lengths()) == [data_point_length(theirs[i]) for i in range(len(theirs))], name


def test_wnut16_column_files_read_as_flairs_column_corpus(tmp_path: Path) -> None:
    reference = wnut16_corpus(tmp_path / "wnut16")
    mapped = MappedCorpus.from_column_files(
        tmp_path / "wnut16",
        {0: "text", 1: "ner"},
        train_file="train.txt",
        dev_file="dev.txt",
        test_file="test.txt",
        column_delimiter="\t",
        sample_missing_splits=False,
        cache_folder=tmp_path / "cache",
    )
    assert len(mapped.train) == len(reference.train) == 1794
    _same_splits(mapped, reference)
    assert sum(len(s.get_spans("ner")) for s in mapped.train) == sum(len(s.get_spans("ner")) for s in reference.train)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"document_separator_token": "-DOCSTART-"},
        {"comment_symbol": None, "label_name_map": {"PER": "person", "LOC": "O", "VBD": "verb"}},
        {"documents_as_sentences": True, "document_separator_token": "-DOCSTART-"},
        {"every_sentence_is_independent": True, "banned_sentences": ["Tokyo"]},
    ],
    ids=["plain", "document-separator", "label-map-no-comments", "documents-as-sentences", "independent-banned"],
)
def test_edge_case_column_files_read_as_flairs_column_corpus(tmp_path: Path, options: dict) -> None:
    """Blank-line runs, comments with metadata, document separators, Unicode, a token-level and two span columns
    (BIO and BIOES), spans ending their sentence, a line without the span columns; flair's options."""
    for name in ("train.txt", "dev.txt", "test.txt"):
        write(tmp_path / "columns" / name, COLUMNS)
    reference = ColumnCorpus(tmp_path / "columns", COLUMN_FORMAT, **options)
    mapped = MappedCorpus.from_column_files(tmp_path / "columns", COLUMN_FORMAT, cache_folder=tmp_path / "c", **options)
    _same_splits(mapped, reference)


def test_column_spans_at_the_ends_and_boundaries_are_flairs(tmp_path: Path) -> None:
    """The stored spans are flair's spans, not one token off: named on their exact tokens."""
    write(tmp_path / "c" / "train.txt", COLUMNS)
    mapped = MappedCorpus.from_column_files(
        tmp_path / "c",
        COLUMN_FORMAT,
        sample_missing_splits=False,
        document_separator_token="-DOCSTART-",
        cache_folder=tmp_path / "x",
    )
    first = mapped.train[1]
    assert [(span.text, span.get_label("ner").value) for span in first.get_spans("ner")] == [
        ("George Washington", "PER"),
        ("Zürich", "LOC"),
    ]
    assert [(span.text, span.get_label("np").value) for span in first.get_spans("np")][-1] == ("Zürich", "NP")
    assert [token.get_label("pos").value for token in first] == ["NNP", "NNP", "VBD", "O", "NNP"]
    assert mapped.train[0].is_document_boundary and not first.is_document_boundary
    assert mapped.train[0].get_metadata("domain") == "news\n"  # flair keeps the line end in comment metadata


def test_a_missing_dev_split_is_sampled_from_train_as_flair_samples_it(tmp_path: Path) -> None:
    reference_folder = tmp_path / "w"
    wnut16_corpus(reference_folder)
    (reference_folder / "dev.txt").unlink()
    random.seed(7)
    reference = ColumnCorpus(reference_folder, {0: "text", 1: "ner"}, column_delimiter="\t")
    random.seed(7)
    mapped = MappedCorpus.from_column_files(
        reference_folder, {0: "text", 1: "ner"}, column_delimiter="\t", cache_folder=tmp_path / "c"
    )
    _same_splits(mapped, reference)
    seeded = MappedCorpus.from_column_files(
        reference_folder, {0: "text", 1: "ner"}, column_delimiter="\t", cache_folder=tmp_path / "c", random_seed=3
    )
    expected = ColumnCorpus(reference_folder, {0: "text", 1: "ner"}, column_delimiter="\t", random_seed=3)
    _same_splits(seeded, expected)


def _trec_fasttext(folder: Path) -> Path:
    lines = []
    for line in TREC_FILE.read_text(encoding="utf-8").splitlines()[:1500]:
        label, text = line.split(" ", 1)
        coarse, fine = label.split(":", 1)
        lines.append(f"__label__{coarse} __label__{fine} {text}")
    write(folder / "train.txt", "\n".join(lines[:1200]) + "\n")
    write(folder / "test.txt", "\n".join(lines[1200:1350]) + "\n")
    write(folder / "dev.txt", "\n".join(lines[1350:]) + "\n")
    return folder


def test_trec_fasttext_files_read_as_flairs_classification_corpus(tmp_path: Path) -> None:
    folder = _trec_fasttext(tmp_path / "trec")
    reference = ClassificationCorpus(folder, label_type="question")
    mapped = MappedCorpus.from_classification_files(folder, label_type="question", cache_folder=tmp_path / "c")
    _same_splits(mapped, reference)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"truncate_to_max_tokens": 4, "label_name_map": {"A": "alpha"}},
        {"truncate_to_max_chars": 12, "tokenizer": SpaceTokenizer()},
        {"filter_if_longer_than": 6, "skip_labels": ["B"]},
        {"allow_examples_without_labels": True, "memory_mode": "full"},
    ],
    ids=["plain", "tokens-and-label-map", "chars-space-tokenizer", "filter-skip", "without-labels-full"],
)
def test_fasttext_edge_cases_read_as_flair(tmp_path: Path, options: dict) -> None:
    """Several labels on a line, tabs, lines without labels or without text, Unicode; flair's truncations."""
    for name in ("train.txt", "dev.txt", "test.txt"):
        write(tmp_path / "ft" / name, FASTTEXT)
    reference = ClassificationCorpus(tmp_path / "ft", label_type="topic", **options)
    mapped = MappedCorpus.from_classification_files(
        tmp_path / "ft", label_type="topic", cache_folder=tmp_path / "c", **options
    )
    _same_splits(mapped, reference)


@pytest.mark.parametrize(
    "column_name_map",
    [{0: "text", 1: "label"}, {0: "text", 1: "label", 3: "pair"}, {3: "text", 0: "text", 1: "label_topic"}],
    ids=["text-label", "pair", "two-text-columns"],
)
def test_csv_read_as_flairs_csv_classification_corpus(tmp_path: Path, column_name_map: dict) -> None:
    for name in ("train.csv", "dev.csv", "test.csv"):
        write(tmp_path / "csv" / name, CSV)
    options = {"skip_header": True, "max_tokens_per_doc": 3, "no_class_label": "neg"}
    reference = CSVClassificationCorpus(tmp_path / "csv", column_name_map, label_type="sentiment", **options)
    mapped = MappedCorpus.from_csv(
        tmp_path / "csv", column_name_map, "sentiment", cache_folder=tmp_path / "c", **options
    )
    _same_splits(mapped, reference)
    assert len(mapped.train) == 4


def test_a_corpus_in_memory_is_mapped_with_the_same_data_points(tmp_path: Path) -> None:
    """map_corpus: TREC built in memory (sentence labels) and a linked ColumnCorpus (context links kept)."""
    trec = trec_corpus(train_size=600, dev_size=50, test_size=50)
    mapped = map_corpus(trec, cache_folder=tmp_path / "c")
    _same_splits(mapped, trec)
    again = map_corpus(trec, cache_folder=tmp_path / "c")
    assert (mapped.built, again.built) == (True, False)
    write(tmp_path / "col" / "train.txt", COLUMNS)
    columns = ColumnCorpus(
        tmp_path / "col", COLUMN_FORMAT, sample_missing_splits=False, document_separator_token="-DOCSTART-"
    )
    _same_splits(map_corpus(columns, cache_folder=tmp_path / "c"), columns)


def test_lengths_are_read_from_the_split_they_belong_to(tmp_path: Path) -> None:
    trec = trec_corpus(train_size=300, dev_size=40, test_size=30)
    mapped = map_corpus(trec, cache_folder=tmp_path / "c")
    for name in ("train", "dev", "test"):
        split = getattr(trec, name)
        expected = np.array([data_point_length(split[i]) for i in range(len(split))])
        assert np.array_equal(getattr(mapped, name).lengths(), expected), name


def _scored(line: str, number: int) -> Sentence:
    label, text = line.split(" ", 1)
    sentence = Sentence(text)
    sentence.add_label("question", label.split(":")[0], 0.05 + number * 0.0125)
    sentence[0].add_label("pos", "W", 0.25 + number / 1000)
    sentence[1:3].add_label("ner", "X", 0.5 - number / 1000)
    for key, value in {"index": number, "weight": number / 8, "checked": number % 2 == 0, "from": "trec"}.items():
        sentence.add_metadata(key, value)
    return sentence


def test_label_scores_and_metadata_of_a_corpus_in_memory_are_kept(tmp_path: Path) -> None:
    """flair's readers give every label a score of 1.0: a corpus in memory (as a model's predictions make it) has
    others, on sentence, token, span and pair labels; and metadata of numbers and booleans."""
    lines = TREC_FILE.read_text(encoding="utf-8").splitlines()[:50]
    sentences = [_scored(line, number) for number, line in enumerate(lines[:40])]
    pairs = []
    for number in range(5):
        pair = DataPair(_scored(lines[40 + 2 * number], 40 + number), Sentence(lines[41 + 2 * number]))
        pair.add_label("entailment", "yes" if number % 2 else "no", 0.3 + number / 10)
        pairs.append(pair)
    corpus = Corpus(
        FlairDatapointDataset(sentences[:30]),
        FlairDatapointDataset(sentences[30:]),
        FlairDatapointDataset(pairs),
        sample_missing_splits=False,
    )
    mapped = map_corpus(corpus, cache_folder=tmp_path / "c")
    _same_splits(mapped, corpus)
    scores = {label.score for split in (mapped.train, mapped.test) for point in split for label in point.labels}
    assert len(scores - {1.0}) > 40, scores
    assert [repr(mapped.dev[i]._metadata) for i in range(10)] == [repr(corpus.dev[i]._metadata) for i in range(10)]


def test_head_ids_of_a_column_file_are_flairs(tmp_path: Path) -> None:
    """A dependency column ("head"): each token's head id as flair's reader gives it."""
    text = "The\t2\tdet\ncat\t3\tnsubj\nsat\t0\troot\n\nIt\t2\tnsubj\nended\t0\troot\n.\t2\tpunct\n"
    write(tmp_path / "dep" / "train.txt", text)
    columns = {0: "text", 1: "head", 2: "deprel"}
    reference = ColumnCorpus(tmp_path / "dep", columns, column_delimiter="\t", sample_missing_splits=False)
    mapped = MappedCorpus.from_column_files(
        tmp_path / "dep", columns, column_delimiter="\t", sample_missing_splits=False, cache_folder=tmp_path / "c"
    )
    _same_splits(mapped, reference)
    assert [[token.head_id for token in sentence] for sentence in mapped.train] == [[2, 3, 0], [2, 0, 2]]


def _parameters(function: Any) -> dict[str, Any]:
    """Each parameter's name, kind and default (an object default by its type and attributes), in order."""
    return {
        name: (
            parameter.kind,
            (type(parameter.default), vars(parameter.default))
            if hasattr(parameter.default, "__dict__")
            else parameter.default,
        )
        for name, parameter in inspect.signature(function).parameters.items()
        if name != "self"
    }


def test_the_builders_take_flairs_arguments_with_flairs_names_and_defaults(tmp_path: Path) -> None:
    """from_classification_files and from_csv: flair's class's parameters (names, order, defaults) plus cache_folder
    and storage_options (docs/storage.md);
    from_column_files: ColumnCorpus's, with the ColumnDataset and Corpus arguments it passes on by name; in_memory
    changes nothing (the same entry, the same data points)."""
    for builder, flairs in (
        (MappedCorpus.from_classification_files, ClassificationCorpus),
        (MappedCorpus.from_csv, CSVClassificationCorpus),
    ):
        ours = _parameters(builder)
        assert ours.pop("cache_folder")[1] is None and ours.pop("storage_options")[1] is None
        assert list(ours.items()) == list(_parameters(flairs.__init__).items()), builder.__name__
    ours = _parameters(MappedCorpus.from_column_files)
    assert ours.pop("cache_folder")[1] is None and ours.pop("storage_options")[1] is None
    passed_on = {**_parameters(ColumnDataset.__init__), **_parameters(Corpus.__init__)}
    column_corpus = _parameters(ColumnCorpus.__init__)
    column_corpus.pop("corpusargs")
    for name, described in ours.items():
        expected = column_corpus.get(name, passed_on.get(name))
        assert expected is not None and described[1] == expected[1], name
    assert [name for name in ours if name in column_corpus] == list(column_corpus)
    write(tmp_path / "col" / "train.txt", COLUMNS)
    stored = MappedCorpus.from_column_files(
        tmp_path / "col", COLUMN_FORMAT, cache_folder=tmp_path / "c", in_memory=True
    )
    again = MappedCorpus.from_column_files(
        tmp_path / "col", COLUMN_FORMAT, cache_folder=tmp_path / "c", in_memory=False
    )
    assert (stored.built, again.built) == (True, False)
    assert describe_split(again.train) == describe_split(stored.train)


def test_map_corpus_drops_neighbour_links_that_do_not_follow_the_splits_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ColumnCorpus whose dev split flair sampled from train (a Subset: its sentences link to train's)."""
    write(tmp_path / "col" / "train.txt", COLUMNS * 10)
    random.seed(1)
    sampled = ColumnCorpus(tmp_path / "col", COLUMN_FORMAT)
    assert sampled.train[1].previous_sentence() is not None
    with caplog.at_level("WARNING", logger="flair"):
        mapped = map_corpus(sampled, cache_folder=tmp_path / "c")
    assert "the sentences' neighbour links do not follow the splits' order; not kept" in caplog.text
    assert mapped.train[1].previous_sentence() is None and len(mapped.dev) == len(sampled.dev) > 0
