"""The two real data sets shipped with flair-fabric, as flair corpora with fixed, seeded splits.

Both are read from ``flair_fabric/data`` (see ``flair_fabric/data/PROVENANCE.md``); nothing is downloaded.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from flair.data import Corpus, Sentence
from flair.datasets import ColumnCorpus, FlairDatapointDataset
from flair.tokenization import SpaceTokenizer

DATA_DIR = Path(__file__).parent / "data"
TREC_FILE = DATA_DIR / "trec" / "questions.txt"
WNUT16_FILE = DATA_DIR / "wnut16" / "wnut16_train.conll"
TREC_LABEL_TYPE = "question_class"
WNUT16_LABEL_TYPE = "ner"


def _split(items: list, sizes: tuple[int | None, int, int], seed: int) -> tuple[list, list, list]:
    """Shuffle ``items`` with ``seed`` and cut test, dev, then train (``None`` train size: all the rest)."""
    train_size, dev_size, test_size = sizes
    if dev_size + test_size > len(items):
        raise ValueError(f"dev_size + test_size = {dev_size + test_size} exceeds the {len(items)} items available.")
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    test, dev, rest = shuffled[:test_size], shuffled[test_size : test_size + dev_size], shuffled[test_size + dev_size :]
    train = rest if train_size is None else rest[:train_size]
    return train, dev, test


def trec_questions() -> list[tuple[str, str]]:
    """All TREC questions as ``(coarse_label, text)`` pairs, in file order."""
    questions = []
    for line in TREC_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            label, text = line.split(" ", 1)
            questions.append((label.split(":", 1)[0], text.strip()))
    return questions


def trec_corpus(train_size: int | None = None, dev_size: int = 500, test_size: int = 500, seed: int = 42) -> Corpus:
    """TREC question classification (6 coarse classes, label type ``question_class``) with a seeded split."""
    return TREC(train_size, dev_size, test_size, seed)


def wnut16_corpus(
    data_folder: str | Path, train_size: int | None = None, dev_size: int = 300, test_size: int = 300, seed: int = 42
) -> ColumnCorpus:
    """WNUT-16 NER (BIO tags, label type ``ner``) as a flair ``ColumnCorpus`` with a seeded split.

    The split files are written to ``data_folder`` and read back by flair's own ``ColumnCorpus``.
    """
    return WNUT16(train_size, dev_size, test_size, seed, split_files_to=data_folder)


class TREC(Corpus):
    """TREC question classification (6 coarse classes, label type ``question_class``) with a seeded split: the
    shipped questions, shuffled with ``seed`` and cut into test, dev, then train (``None``: all the rest)."""

    def __init__(self, train_size: int | None = None, dev_size: int = 500, test_size: int = 500, seed: int = 42):
        tokenizer = SpaceTokenizer()

        def dataset(pairs: list[tuple[str, str]]) -> FlairDatapointDataset:
            sentences = []
            for label, text in pairs:
                sentence = Sentence(text, use_tokenizer=tokenizer)
                sentence.add_label(TREC_LABEL_TYPE, label)
                sentences.append(sentence)
            return FlairDatapointDataset(sentences)

        train, dev, test = _split(trec_questions(), (train_size, dev_size, test_size), seed)
        super().__init__(dataset(train), dataset(dev), dataset(test), name="trec6", sample_missing_splits=False)


class WNUT16(ColumnCorpus):
    """WNUT-16 NER (BIO tags, label type ``ner``) as flair's ``ColumnCorpus``, with a seeded split of the shipped
    tweets (test, dev, then train; ``None``: all the rest). The split is written as CoNLL files that flair reads:
    into ``split_files_to``, or a temporary folder removed once they are read."""

    def __init__(
        self,
        train_size: int | None = None,
        dev_size: int = 300,
        test_size: int = 300,
        seed: int = 42,
        split_files_to: str | Path | None = None,
    ):
        tweets = [block for block in WNUT16_FILE.read_text(encoding="utf-8").split("\n\n") if block.strip()]
        splits = _split(tweets, (train_size, dev_size, test_size), seed)
        with tempfile.TemporaryDirectory() as temporary:
            folder = Path(split_files_to if split_files_to is not None else temporary)
            folder.mkdir(parents=True, exist_ok=True)
            for name, blocks in zip(("train.txt", "dev.txt", "test.txt"), splits, strict=True):
                text = "\n\n".join(block.strip("\n") for block in blocks) + "\n\n"
                (folder / name).write_text(text, encoding="utf-8")
            super().__init__(
                folder,
                {0: "text", 1: WNUT16_LABEL_TYPE},
                train_file="train.txt",
                dev_file="dev.txt",
                test_file="test.txt",
                column_delimiter="\t",
                sample_missing_splits=False,
            )
