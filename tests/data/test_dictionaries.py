"""The dictionaries a mapped corpus gives (label dictionary, vocabulary, one-hot vocabulary) are flair's for the
same data: the same items in the same order, the same flags, computed without building the data points."""

from __future__ import annotations

from pathlib import Path

import pytest
from flair.data import Dictionary
from flair.datasets import ClassificationCorpus, ColumnCorpus, CSVClassificationCorpus
from flair.embeddings import OneHotEmbeddings

from flair_fabric.data import MappedCorpus, map_corpus
from flair_fabric.data import split as split_module
from flair_fabric.datasets import trec_corpus, wnut16_corpus

from .reference import COLUMN_FORMAT, COLUMNS, CSV, FASTTEXT, write


def _same(ours: Dictionary, theirs: Dictionary) -> None:
    assert ours.get_items() == theirs.get_items()
    assert (ours.multi_label, ours.span_labels, ours.add_unk) == (
        theirs.multi_label,
        theirs.span_labels,
        theirs.add_unk,
    )


@pytest.fixture
def nothing_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a data point fails: the dictionaries come from the stored columns alone."""

    def refuse(*args: object) -> None:
        raise AssertionError("a data point was built")

    monkeypatch.setattr(split_module, "decode", refuse)


def _column_corpora(tmp_path: Path) -> tuple[MappedCorpus, ColumnCorpus]:
    for name in ("train.txt", "dev.txt", "test.txt"):
        write(tmp_path / "col" / name, COLUMNS)
    write(tmp_path / "col" / "dev.txt", "Paris NNP B-CITY S-NP\nis VBZ O S-VP\n")
    reference = ColumnCorpus(tmp_path / "col", COLUMN_FORMAT, document_separator_token="-DOCSTART-")
    mapped = MappedCorpus.from_column_files(
        tmp_path / "col", COLUMN_FORMAT, document_separator_token="-DOCSTART-", cache_folder=tmp_path / "c"
    )
    return mapped, reference


@pytest.mark.parametrize(
    "arguments",
    [
        {"label_type": "ner"},
        {"label_type": "np", "add_unk": True},
        {"label_type": "pos"},
        {"label_type": "ner", "add_dev_test": True},
        {"label_type": "pos", "min_count": 2},
    ],
    ids=["spans", "bioes-unk", "tokens-with-O", "dev-and-test", "min-count"],
)
def test_column_label_dictionaries_are_flairs(tmp_path: Path, arguments: dict, nothing_is_built: None) -> None:
    mapped, reference = _column_corpora(tmp_path)
    _same(mapped.make_label_dictionary(**arguments), reference.make_label_dictionary(**arguments))


def test_wnut16_dictionaries_are_flairs(tmp_path: Path, nothing_is_built: None) -> None:
    reference = wnut16_corpus(tmp_path / "w")
    mapped = MappedCorpus.from_column_files(
        tmp_path / "w",
        {0: "text", 1: "ner"},
        column_delimiter="\t",
        sample_missing_splits=False,
        cache_folder=tmp_path / "c",
    )
    _same(mapped.make_label_dictionary("ner", add_unk=True), reference.make_label_dictionary("ner", add_unk=True))
    for max_tokens, min_freq in ((-1, 1), (100, 1), (-1, 3)):
        _same(mapped.make_vocab_dictionary(max_tokens, min_freq), reference.make_vocab_dictionary(max_tokens, min_freq))
    ours, theirs = mapped.one_hot_embeddings(min_freq=2), OneHotEmbeddings.from_corpus(reference, min_freq=2)
    _same(ours.vocab_dictionary, theirs.vocab_dictionary)
    ours, theirs = (
        mapped.one_hot_embeddings(field="ner", min_freq=1),
        OneHotEmbeddings.from_corpus(reference, field="ner", min_freq=1),
    )
    _same(ours.vocab_dictionary, theirs.vocab_dictionary)


def test_classification_dictionaries_are_flairs(tmp_path: Path, nothing_is_built: None) -> None:
    """Multi-label FastText lines (multi_label set), TREC sentence labels, CSV pairs (labels on the pair)."""
    for name in ("train.txt", "dev.txt", "test.txt"):
        write(tmp_path / "ft" / name, FASTTEXT)
    reference = ClassificationCorpus(tmp_path / "ft", label_type="topic")
    mapped = MappedCorpus.from_classification_files(tmp_path / "ft", label_type="topic", cache_folder=tmp_path / "c")
    _same(mapped.make_label_dictionary("topic"), reference.make_label_dictionary("topic"))
    trec = trec_corpus(train_size=500, dev_size=20, test_size=20)
    _same(
        map_corpus(trec, cache_folder=tmp_path / "c").make_label_dictionary("question_class"),
        trec.make_label_dictionary("question_class"),
    )
    for name in ("train.csv", "dev.csv", "test.csv"):
        write(tmp_path / "csv" / name, CSV)
    columns = {0: "text", 1: "label", 3: "pair"}
    pairs = CSVClassificationCorpus(tmp_path / "csv", columns, "sentiment", skip_header=True)
    mapped_pairs = MappedCorpus.from_csv(
        tmp_path / "csv", columns, "sentiment", skip_header=True, cache_folder=tmp_path / "c"
    )
    _same(
        mapped_pairs.make_label_dictionary("sentiment", add_dev_test=True),
        pairs.make_label_dictionary("sentiment", add_dev_test=True),
    )


def test_a_label_type_not_in_the_corpus_is_refused_as_flair_refuses_it(tmp_path: Path, nothing_is_built: None) -> None:
    mapped, _ = _column_corpora(tmp_path)
    with pytest.raises(ValueError, match=r"(?s)label type \(sentiment\) that is not contained.*'ner'"):
        mapped.make_label_dictionary("sentiment")
