"""The length of every train data point, read once per run, for dealing steps by length, grouping batches by length
and counting padded positions.

A length counts what a batch is padded in. For a model whose embeddings include a transformer, that is subwords:
the sentence's words through the transformer's own (fast) tokenizer, special tokens included, as flair's
``TransformerEmbeddings`` feeds them (words in pairs and triples are summed over the parts). Tokenizing a split once
costs little next to training on it (about 0.1 ms a sentence on a CPU core), and subword counts are what a
transformer computes: a word-count sort leaves batches whose subword lengths still differ. Everything else counts words
(:func:`~flair_fabric.training.balancing.data_point_length`). A memory-mapped split stores word counts and is read
from storage: its data points are not built for it (the mapped corpus's point).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flair.data import DataPair, DataTriple, Sentence, _len_dataset
from flair.embeddings.transformer import TransformerBaseEmbeddings
from torch.utils.data import Dataset

from flair_fabric.data.stored import stored_lengths
from flair_fabric.training.balancing import data_point_length

Counter = Callable[[list[list[str]]], list[int]]


def data_point_lengths(train_data: Dataset, model: torch.nn.Module | None = None) -> list[int]:
    """The length of every data point of ``train_data``: stored word counts where the split stores them (nothing is
    built), else :func:`lengths_of` each data point."""
    stored = stored_lengths(train_data)
    if stored is not None:
        return stored
    return length_counter(model)([train_data[index] for index in range(_len_dataset(train_data))])


def length_counter(model: torch.nn.Module | None) -> Callable[[list], list[int]]:
    """A function giving the lengths of a list of data points: subword counts for a model with transformer
    embeddings (see the module doc), word counts otherwise."""
    counter = subword_counter(model) if model is not None else None
    if counter is None:
        return lambda points: [data_point_length(point) for point in points]
    return lambda points: _subword_lengths(points, counter)


def _subword_lengths(points: list, counter: Counter) -> list[int]:
    parts = [_sentences_of(point) for point in points]
    counted = counter([[token.text for token in sentence] for sentences in parts for sentence in sentences])
    lengths, position = [], 0
    for point, sentences in zip(points, parts, strict=True):
        if not sentences:  # not made of sentences: as the word count has it
            lengths.append(data_point_length(point))
            continue
        lengths.append(max(sum(counted[position : position + len(sentences)]), 1))
        position += len(sentences)
    return lengths


def subword_counter(model: torch.nn.Module) -> Counter | None:
    """Counts the subwords of word lists with the first transformer embedding's fast tokenizer in ``model``, or
    ``None`` (no transformer, or a tokenizer that is not a fast one)."""
    for module in model.modules():
        tokenizer = getattr(module, "tokenizer", None) if isinstance(module, TransformerBaseEmbeddings) else None
        if tokenizer is not None and getattr(tokenizer, "is_fast", False):

            def count(words: list[list[str]], tokenizer: object = tokenizer) -> list[int]:
                if not words:
                    return []
                encoded = tokenizer(words, is_split_into_words=True, add_special_tokens=True, truncation=False)  # type: ignore[operator]
                return [len(ids) for ids in encoded["input_ids"]]

            return count
    return None


def _sentences_of(point: object) -> list[Sentence]:
    if isinstance(point, Sentence):
        return [point]
    if isinstance(point, DataTriple):
        return [part for each in (point.first, point.second, point.third) for part in _sentences_of(each)]
    if isinstance(point, DataPair):
        return _sentences_of(point.first) + _sentences_of(point.second)
    return []
