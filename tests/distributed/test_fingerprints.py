"""The ranks' corpora are compared by size, text and labels before training (no processes needed: rank 1's
fingerprints are handed to rank 0's check as the collective would)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed
from flair.data import Corpus

from flair_fabric.datasets import TREC_LABEL_TYPE
from flair_fabric.distributed.fingerprints import check_ranks_agree, corpus_fingerprint, model_fingerprint

from ..support import small_trec, tiny_text_classifier


def _relabel(corpus: Corpus, split: str, index: int) -> tuple[str, str]:
    """Give one data point of ``split`` another label of the same label type; returns (old, new)."""
    sentence = getattr(corpus, split)[index]
    old = sentence.get_label(TREC_LABEL_TYPE).value
    new = next(item for item in corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False).get_items() if item != old)
    sentence.set_label(TREC_LABEL_TYPE, new)
    assert [label.value for label in sentence.get_labels(TREC_LABEL_TYPE)] == [new]
    return old, new


def _as_rank_zero_sees(monkeypatch: pytest.MonkeyPatch, rank_one: Corpus) -> None:
    """``torch.distributed.all_gather_object`` as two ranks would answer it, rank 1 holding ``rank_one``."""

    def all_gather_object(every: list[Any], mine: Any) -> None:
        every[0], every[1] = mine, {"corpus": corpus_fingerprint(rank_one), "model": mine["model"]}

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
