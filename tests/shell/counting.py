"""A corpus class for configs in tests: it counts how often it was made (a check must read no data)."""

from __future__ import annotations

from flair.data import Corpus, Dictionary
from flair.embeddings import CharacterEmbeddings

from flair_fabric.datasets import TREC


class CountingCorpus(TREC):
    """flair-fabric's TREC corpus; ``CountingCorpus.made`` counts the instances made in this process."""

    made = 0

    def __init__(self, train_size: int | None = None, dev_size: int = 500, test_size: int = 500, seed: int = 42):
        type(self).made += 1
        super().__init__(train_size, dev_size, test_size, seed)


class DataWasRead(Exception):
    """Raised by a test's stand-in: a config run got as far as making its corpus and model."""


def character_embeddings(corpus: Corpus, hidden_size_char: int = 25) -> CharacterEmbeddings:
    """Character embeddings over the characters of the corpus's training split (a config's function that takes the
    corpus: docs/shell.md)."""
    characters = Dictionary(add_unk=True)
    for sentence in corpus.train:
        for token in sentence:
            for character in token.text:
                characters.add_item(character)
    return CharacterEmbeddings(characters, hidden_size_char=hidden_size_char)
