"""group_by_length's order, against the rule of docs/launching.md written out here: windows of W global batches,
each sorted by length and cut into batches, the window's batches shuffled, the epoch's longest batch first."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoTokenizer

from flair_fabric.training.grouping import grouped_by_length
from flair_fabric.training.lengths import data_point_lengths

from ..support import make_tiny_bert, small_trec, tiny_text_classifier, tiny_transformer_classifier


def _batches(order: list[int], size: int) -> list[list[int]]:
    return [order[start : start + size] for start in range(0, len(order), size)]


def _padded(batch: list[int], lengths: list[int]) -> int:
    return len(batch) * max(lengths[index] for index in batch)


def test_each_window_keeps_its_points_sorted_into_batches_the_longest_batch_first() -> None:
    for size, batch, window, seed in [(45, 6, 2, 0), (100, 8, 3, 1), (7, 3, 50, 2), (64, 4, 1, 3), (30, 5, 2, 4)]:
        generator = random.Random(seed)
        lengths = [generator.randint(1, 60) for _ in range(size)]
        order = generator.sample(range(size), size)
        torch.manual_seed(seed)
        grouped = grouped_by_length(order, lengths, batch, window, shuffle=True)
        assert sorted(grouped) == list(range(size)), "every data point once"
        batches = _batches(grouped, batch)
        assert all(len(each) == batch for each in batches[:-1]), "only the last batch may be short"
        longest = max(_padded(each, lengths) for each in batches if len(each) == batch or len(batches) == 1)
        assert _padded(batches[0], lengths) == longest, "the epoch's longest batch comes first"
        span = window * batch
        for start in range(0, size, span):
            in_window = order[start : start + span]
            mine = [each for each in batches if set(each) <= set(in_window)]
            assert sorted(index for each in mine for index in each) == sorted(in_window), "a window's own points"
            by_length = sorted(in_window, key=lambda index: -lengths[index])  # equal lengths: the epoch's order
            assert sorted(map(tuple, mine)) == sorted(map(tuple, _batches(by_length, batch)))


def test_the_batches_are_shuffled_from_torchs_generator_and_the_same_for_the_same_seed() -> None:
    lengths = [length % 17 + 1 for length in range(200)]
    order = random.Random(9).sample(range(200), 200)
    torch.manual_seed(5)
    seeded = torch.get_rng_state()
    first = grouped_by_length(order, lengths, 8, 5, shuffle=True)
    assert not torch.equal(torch.get_rng_state(), seeded), "drawn from torch's global generator"
    torch.manual_seed(5)
    assert grouped_by_length(order, lengths, 8, 5, shuffle=True) == first
    torch.manual_seed(6)
    assert grouped_by_length(order, lengths, 8, 5, shuffle=True) != first, "the batches' order is drawn"
    before = torch.get_rng_state()
    unshuffled = grouped_by_length(order, lengths, 8, 5, shuffle=False)
    assert torch.equal(torch.get_rng_state(), before), "shuffle=False draws nothing"
    windows = [unshuffled[start : start + 40] for start in range(0, 200, 40)]
    assert sorted(map(sorted, windows)) == sorted(sorted(order[start : start + 40]) for start in range(0, 200, 40))


def test_grouping_cuts_the_padding_of_random_batches() -> None:
    """Lengths spread like movie-review sentences (1 to 53 words): grouped batches of 16 pad far less."""
    generator = random.Random(3)
    lengths = [min(53, max(1, int(generator.gauss(18.5, 9)))) for _ in range(2000)]
    order = generator.sample(range(2000), 2000)
    torch.manual_seed(0)
    grouped = grouped_by_length(order, lengths, 16, 50, shuffle=True)

    def padding(sequence: list[int]) -> float:
        batches = _batches(sequence, 16)
        padded = sum(_padded(each, lengths) for each in batches)
        return 1 - sum(lengths) / padded

    assert padding(order) > 0.3 and padding(grouped) < 0.05


def test_a_transformer_models_lengths_are_its_subword_counts_and_other_models_count_words(tmp_path: Path) -> None:
    """Against the tokenizer run on each question's text (a separate path from the word lists the lengths use):
    [CLS] + subwords + [SEP]; a model without a transformer counts words."""
    corpus = small_trec(train_size=20)
    model = tiny_transformer_classifier(corpus, make_tiny_bert(tmp_path / "bert", corpus))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "bert")
    expected = [len(tokenizer(sentence.to_tokenized_string())["input_ids"]) for sentence in corpus.train]
    assert data_point_lengths(corpus.train, model) == expected
    words = [len(sentence) for sentence in corpus.train]
    assert data_point_lengths(corpus.train, tiny_text_classifier(corpus)) == words != expected
