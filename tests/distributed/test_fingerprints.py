"""The ranks' corpora are compared by size, text and labels before training (no processes needed: rank 1's
fingerprints are handed to rank 0's check as the collective would)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed
from flair.data import Corpus, Dictionary
from flair.embeddings import OneHotEmbeddings

from flair_fabric.datasets import TREC_LABEL_TYPE, WNUT16_LABEL_TYPE
from flair_fabric.distributed.fingerprints import check_ranks_agree, corpus_fingerprint, model_fingerprint

from ..support import small_trec, small_wnut, tiny_text_classifier


def _relabel(corpus: Corpus, split: str, index: int) -> tuple[str, str]:
    """Give one data point of ``split`` another label of the same label type; returns (old, new)."""
    sentence = getattr(corpus, split)[index]
    old = sentence.get_label(TREC_LABEL_TYPE).value
    new = next(item for item in corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False).get_items() if item != old)
    sentence.set_label(TREC_LABEL_TYPE, new)
    assert [label.value for label in sentence.get_labels(TREC_LABEL_TYPE)] == [new]
    return old, new


def _as_rank_zero_sees(monkeypatch: pytest.MonkeyPatch, rank_one: Corpus, model: Any = None) -> None:
    """``torch.distributed.all_gather_object`` as two ranks would answer it, rank 1 holding ``rank_one`` (and
    ``model``, else rank 0's model)."""

    def all_gather_object(every: list[Any], mine: Any) -> None:
        theirs = mine["model"] if model is None else model_fingerprint(model)
        every[0], every[1] = mine, {"corpus": corpus_fingerprint(rank_one), "model": theirs}

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)


@pytest.mark.parametrize(("split", "index"), [("train", 0), ("train", 47), ("dev", 5), ("test", 11)])
def test_corpora_with_the_same_texts_and_another_label_are_refused(
    monkeypatch: pytest.MonkeyPatch, split: str, index: int
) -> None:
    """A label counts as much as the text: one data point labelled differently on rank 1 is refused, naming the
    split."""
    mine, theirs = small_trec(), small_trec()
    _relabel(theirs, split, index)
    assert [s.to_original_text() for s in getattr(mine, split)] == [
        s.to_original_text() for s in getattr(theirs, split)
    ]
    assert corpus_fingerprint(mine)[split] != corpus_fingerprint(theirs)[split]
    others = {"train", "dev", "test"} - {split}
    assert all(corpus_fingerprint(mine)[other] == corpus_fingerprint(theirs)[other] for other in others)

    _as_rank_zero_sees(monkeypatch, theirs)
    model = tiny_text_classifier(mine)
    with pytest.raises(ValueError, match=rf"rank 1's corpus differs from rank 0's in {split}\b"):
        check_ranks_agree(SimpleNamespace(world_size=2), _fingerprints(mine, model))


def test_corpora_that_agree_in_text_and_labels_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same corpus built again on rank 1 is accepted (the check compares content, not objects)."""
    mine = small_trec()
    _as_rank_zero_sees(monkeypatch, small_trec())
    check_ranks_agree(SimpleNamespace(world_size=2), _fingerprints(mine, tiny_text_classifier(mine)))


def _fingerprints(corpus: Any, model: Any) -> dict[str, dict[str, str]]:
    return {"corpus": corpus_fingerprint(corpus), "model": model_fingerprint(model)}


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_that_differ_are_refused_on_every_rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """Every rank compares every rank's fingerprints with rank 0's (not only its own): rank 0 and rank 1 alike refuse
    a rank 1 whose corpus differs, with the same error naming rank 1 and the splits."""
    mine, theirs = small_trec(), small_trec(seed=4)  # e.g. a data file that changed between the processes' reads
    model = tiny_text_classifier(mine)
    every = [_fingerprints(mine, model), _fingerprints(theirs, model)]

    def all_gather_object(gathered: list[Any], own: Any) -> None:
        assert own == every[rank]
        gathered[:] = every

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    with pytest.raises(ValueError, match=r"rank 1's corpus differs from rank 0's in dev, test, train"):
        check_ranks_agree(SimpleNamespace(world_size=2, global_rank=rank), every[rank])


def test_a_vocabulary_of_an_embedding_in_another_order_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The items of every flair Dictionary in the model, also inside its embeddings (a vocabulary built from a set
    on one rank), in order: the same items in another order are refused, naming the dictionary."""
    corpus = small_trec()
    mine, theirs = tiny_text_classifier(corpus), tiny_text_classifier(corpus)
    [(path, words)] = [(name, m) for name, m in theirs.named_modules() if isinstance(m, OneHotEmbeddings)]
    vocabulary = Dictionary(add_unk=False)
    for item in reversed(words.vocab_dictionary.get_items()):
        vocabulary.add_item(item)
    words.vocab_dictionary = vocabulary
    expected = f"dictionary {path}.vocab_dictionary"
    ours, others = model_fingerprint(mine), model_fingerprint(theirs)
    assert {key for key in ours.keys() | others.keys() if ours.get(key) != others.get(key)} == {expected}

    _as_rank_zero_sees(monkeypatch, corpus, theirs)
    with pytest.raises(ValueError, match=rf"rank 1's model differs from rank 0's in {re.escape(expected)}\b"):
        check_ranks_agree(SimpleNamespace(world_size=2, global_rank=0), _fingerprints(corpus, mine))


def test_corpora_whose_span_labels_sit_on_other_tokens_are_refused(tmp_path: Path) -> None:
    """A label counts with what it is attached to: the same texts and label values, one entity moved by a token."""
    mine, theirs = small_wnut(tmp_path / "mine"), small_wnut(tmp_path / "theirs")
    index, sentence = next((i, s) for i, s in enumerate(theirs.train) if s.get_labels(WNUT16_LABEL_TYPE))
    label = sentence.get_labels(WNUT16_LABEL_TYPE)[0]
    span = label.data_point
    start, end = span.tokens[0].idx - 1, span.tokens[-1].idx
    span.remove_labels(WNUT16_LABEL_TYPE)
    moved = sentence[start + 1 : end + 1] if end < len(sentence) else sentence[start - 1 : end - 1]
    moved.add_label(WNUT16_LABEL_TYPE, label.value)
    ours = mine.train[index]
    assert ours.to_original_text() == sentence.to_original_text()
    assert [x.value for x in ours.get_labels(WNUT16_LABEL_TYPE)] == [
        x.value for x in sentence.get_labels(WNUT16_LABEL_TYPE)
    ]
    assert corpus_fingerprint(mine)["train"] != corpus_fingerprint(theirs)["train"]
    assert all(corpus_fingerprint(mine)[split] == corpus_fingerprint(theirs)[split] for split in ("dev", "test"))
