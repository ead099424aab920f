"""flair's dictionaries of a corpus (label dictionary, vocabulary, one-hot vocabularies), computed from the stored
columns without building a data point, with flair's items in flair's order (``Counter.most_common``: by count, ties
in order of first appearance, data points in the split's order and labels in the order flair's ``get_labels`` gives:
a sentence's sorted by their target's start position)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

from flair.data import DataPair, Dictionary, Sentence, Span, Token

from flair_fabric.data.columns import ITSELF, SPAN, TOKEN
from flair_fabric.data.split import MappedSplit

log = logging.getLogger("flair")

_SENTENCE_COLUMNS = ["labels", "n_tokens", "token_starts", "start_position"]
_PAIR_COLUMNS = ["pair_labels", "first.n_tokens", "second.n_tokens"]


def _rows(splits: list[MappedSplit]) -> Iterator[tuple[list[dict], int, list[int], int, bool]]:
    """Each data point's own labels (a sentence's: all of them), its length, token starts and start position."""
    for split in splits:
        if split.is_pair:
            for chunk in split.columns(_PAIR_COLUMNS):
                for labels, first, second in zip(*(chunk[name] for name in _PAIR_COLUMNS), strict=False):
                    yield labels, first + second, [], 0, True
        else:
            for chunk in split.columns(_SENTENCE_COLUMNS):
                yield from ((*row, False) for row in zip(*(chunk[name] for name in _SENTENCE_COLUMNS), strict=False))


def _labels_of(labels: list[dict], label_type: str, starts: list[int], start: int, pair: bool) -> list[dict]:
    """The labels flair's ``get_labels(label_type)`` gives: a sentence's sorted by their target's start position."""
    chosen = [label for label in labels if label["type"] == label_type]
    if pair:
        return chosen
    return sorted(chosen, key=lambda label: start if label["target"] == ITSELF else starts[label["start"]])


def _target_type(label: dict, pair: bool) -> type:
    return {ITSELF: DataPair if pair else Sentence, TOKEN: Token, SPAN: Span}[label["target"]]


def label_dictionary(
    splits: list[MappedSplit], label_type: str, min_count: int = -1, add_unk: bool = False
) -> Dictionary:
    """What flair's ``Corpus.make_label_dictionary`` gives for a corpus whose data are ``splits``, concatenated."""
    if min_count > 0 and not add_unk:
        add_unk = True
    dictionary = Dictionary(add_unk=add_unk)
    dictionary.span_labels = False
    target: type | None = None
    for labels, _, starts, start, pair in _rows(splits):
        for label in _labels_of(labels, label_type, starts, start, pair):
            target = _target_type(label, pair)
        if target:
            break
    if target is Span:
        dictionary.span_labels = True
    types: Counter[str] = Counter()
    values: Counter[str] = Counter()
    for labels, length, starts, start, pair in _rows(splits):
        types.update(list(dict.fromkeys(label["type"] for label in labels)))
        chosen = _labels_of(labels, label_type, starts, start, pair)
        values.update(label["value"] for label in chosen)
        if target is Token and length > len(chosen):
            values["O"] += length - len(chosen)
        if not dictionary.multi_label and len(chosen) > 1:
            dictionary.multi_label = True
    for value, count in values.most_common():
        if count >= min_count:
            dictionary.add_item(value)
    if len(dictionary.idx2item) == 0 or (len(dictionary.idx2item) == 1 and dictionary.has_item("<unk>")):
        contained = ", ".join(f"'{name}' (in {count} sentences)" for name, count in types.most_common())
        raise ValueError(f"You specified a label type ({label_type}) that is not contained in the corpus:\n{contained}")
    log.info(f"Dictionary created for label '{label_type}' with {len(dictionary)} values (from the stored columns)")
    return dictionary


def token_counter(split: MappedSplit, field: str = "text") -> Counter[str]:
    """How often each token text (or, for another ``field``, each token's first label of that type, ``"O"`` where
    it has none) occurs in ``split``, counted in flair's order. Only for splits of sentences."""
    counter: Counter[str] = Counter()
    if field == "text":
        for chunk in split.columns(["tokens"]):
            for tokens in chunk["tokens"]:
                counter.update(tokens)
        return counter
    for chunk in split.columns(["labels", "n_tokens"]):
        for labels, length in zip(chunk["labels"], chunk["n_tokens"], strict=False):
            first: dict[int, str] = {}
            for label in labels:
                if label["target"] == TOKEN and label["type"] == field:
                    first.setdefault(label["start"], label["value"])
            counter.update(first.get(position, "O") for position in range(length))
    return counter


def most_common(counter: Counter[str], max_tokens: int = -1, min_freq: int = 1) -> list[str]:
    """flair's cut of a counter: most frequent first, stopping below ``min_freq`` or at ``max_tokens`` (-1: none)."""
    kept: list[str] = []
    for token, frequency in counter.most_common():
        if (min_freq != -1 and frequency < min_freq) or (max_tokens != -1 and len(kept) == max_tokens):
            break
        kept.append(token)
    return kept
