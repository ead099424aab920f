"""Bad input is refused with a specific error: a malformed line names the file, the line number and what was
expected; data points that cannot be stored name what is supported. Nothing is cached."""

from __future__ import annotations

from pathlib import Path

import pytest
from flair.data import Corpus, DataTriple, Image, Relation, Sentence
from flair.datasets import FlairDatapointDataset

from flair_fabric.data import MalformedLineError, MappedCorpus, UnsupportedDataPointError, map_corpus

from .reference import write


def _entries(cache: Path) -> list[str]:
    return sorted(path.name for path in cache.iterdir() if path.name != "locks") if cache.exists() else []


def test_a_column_line_without_its_token_column_names_file_line_and_what_was_expected(tmp_path: Path) -> None:
    write(tmp_path / "c" / "train.txt", "O Paris\nO is\n\nO nice\nB-X\nO here\n")
    with pytest.raises(
        MalformedLineError, match=r"train\.txt, line 5: expected at least 2 columns separated by '\\\\s\+', found 1"
    ):
        MappedCorpus.from_column_files(
            tmp_path / "c", {0: "ner", 1: "text"}, sample_missing_splits=False, cache_folder=tmp_path / "x"
        )
    assert _entries(tmp_path / "x") == []


def test_bytes_that_are_not_text_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c" / "train.txt"
    path.parent.mkdir()
    path.write_bytes(b"Paris B-LOC\n\n" * 3 + b"caf\xe9 O\n")
    with pytest.raises(MalformedLineError, match=r"train\.txt, line 7: expected text in utf-8"):
        MappedCorpus.from_column_files(
            tmp_path / "c", {0: "text", 1: "ner"}, sample_missing_splits=False, cache_folder=tmp_path / "x"
        )
    path.write_bytes(b"__label__a fine\n__label__b caf\xe9\n")
    with pytest.raises(MalformedLineError, match=r"train\.txt, line 2: expected text in utf-8"):
        MappedCorpus.from_classification_files(tmp_path / "c", sample_missing_splits=False, cache_folder=tmp_path / "x")


def test_a_csv_row_without_its_label_column_names_file_and_line(tmp_path: Path) -> None:
    write(
        tmp_path / "c" / "train.csv",
        "a text,pos\nanother\nshort,neg\nthird\n".replace("another\n", "another,neg\n").replace("third\n", "third\n"),
    )
    write(tmp_path / "c" / "train.csv", "a text,pos,x\nanother,neg,y\nshort,neg\n")
    with pytest.raises(MalformedLineError, match=r"train\.csv, line 3: expected 3 columns, found 2"):
        MappedCorpus.from_csv(
            tmp_path / "c",
            {0: "text", 1: "label", 2: "label_other"},
            "s",
            sample_missing_splits=False,
            cache_folder=tmp_path / "x",
        )


def _corpus(point: object) -> Corpus:
    return Corpus(FlairDatapointDataset([point]), sample_missing_splits=False)  # type: ignore[list-item]


def test_data_points_that_cannot_be_stored_are_refused_naming_what_is_supported(tmp_path: Path) -> None:
    sentence = Sentence("Ann met Bob in Rome")
    Relation(sentence[0:1], sentence[2:3]).add_label("relation", "met")
    with pytest.raises(
        UnsupportedDataPointError,
        match=r"label \(relation\) on a Relation: supported are flair Sentences and DataPairs",
    ):
        map_corpus(_corpus(sentence), cache_folder=tmp_path / "x")
    triple = DataTriple(Sentence("a"), Sentence("b"), Sentence("c"))
    with pytest.raises(
        UnsupportedDataPointError, match=r"cannot store a DataTriple: supported are flair Sentences and DataPairs"
    ):
        map_corpus(_corpus(triple), cache_folder=tmp_path / "x")
    with pytest.raises(UnsupportedDataPointError, match=r"cannot store a Image: supported are flair Sentences"):
        map_corpus(_corpus(Image(imageURL="picture.png")), cache_folder=tmp_path / "x")
    scored = Sentence("Ann met Bob")
    scored.add_label("topic", "people", 0.5, source="a model")
    with pytest.raises(UnsupportedDataPointError, match=r"cannot store label metadata \(topic=people\): supported"):
        map_corpus(_corpus(scored), cache_folder=tmp_path / "x")
    listed = Sentence("Ann met Bob")
    listed.add_metadata("ids", [1, 2])
    with pytest.raises(UnsupportedDataPointError, match=r"cannot store the metadata ids=\[1, 2\] \(list\)"):
        map_corpus(_corpus(listed), cache_folder=tmp_path / "x")
    assert _entries(tmp_path / "x") == []
