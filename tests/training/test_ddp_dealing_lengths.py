"""The lengths by which balance_batches deals each step's data points to the ranks: tokens per data point, a sentence's,
a pair's or a triple's summed."""

from __future__ import annotations

from flair.data import DataPair, DataTriple, Sentence

from flair_fabric.training.balancing import data_point_length
from flair_fabric.training.lengths import data_point_lengths


def test_ddp_dealing_counts_the_tokens_of_a_sentence_and_sums_a_pairs_and_a_triples_parts() -> None:
    """Counted by hand: a sentence of 4 tokens is 4; a pair of 2 + 3 tokens is 5; a triple of 2 + 3 + 6 is 11, in
    whatever order the parts come."""
    sentence = Sentence("What is it ?")
    pair = DataPair(Sentence("a b"), Sentence("c d e"))
    swapped = DataPair(Sentence("c d e"), Sentence("a b"))
    triple = DataTriple(Sentence("a b"), Sentence("c d e"), Sentence("f g h i j k"))
    last_longest = DataTriple(Sentence("f"), Sentence("a b"), Sentence("c d e f g h i j k l"))
    assert data_point_length(sentence) == 4
    assert data_point_length(pair) == data_point_length(swapped) == 5
    assert data_point_length(triple) == 11
    assert data_point_length(last_longest) == 13
    # what a run reads for its train split, once, before dealing
    assert data_point_lengths([sentence, pair, triple, last_longest, swapped]) == [4, 5, 11, 13, 5]
