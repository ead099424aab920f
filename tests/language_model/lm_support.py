"""A tiny character language model on Jane Austen's text (flair_fabric/data/austen), for tests of seconds."""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.data import Dictionary
from flair.models import LanguageModel
from flair.trainers.language_model_trainer import TextCorpus

from flair_fabric.language_model import trainer as language_model_trainer

LM_OPTIONS = {"sequence_length": 20, "max_epochs": 2, "num_workers": 0, "learning_rate": 5.0}
"""Two epochs (the second reads the split files in shuffled order), SGD with flair's plateau schedule."""
AUSTEN = Path(__file__).resolve().parents[2] / "flair_fabric" / "data" / "austen" / "persuasion.txt"


def write_tiny_corpus(folder: Path, splits: int = 3, split_chars: int = 3000, held_out_chars: int = 1200) -> Path:
    """``splits`` train split files, ``valid.txt`` and ``test.txt`` cut from Persuasion at line ends."""
    lines = [line for line in AUSTEN.read_text(encoding="utf-8").splitlines()[60:] if line.strip()]
    parts: list[list[str]] = []
    current: list[str] = []
    sizes = [split_chars] * splits + [held_out_chars, held_out_chars]
    for line in lines:
        current.append(line)
        if sum(len(text) + 1 for text in current) >= sizes[len(parts)]:
            parts.append(current)
            current = []
            if len(parts) == len(sizes):
                break
    (folder / "train").mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(parts[:splits], start=1):
        (folder / "train" / f"train_split_{index}").write_text("\n".join(part) + "\n", encoding="utf-8")
    (folder / "valid.txt").write_text("\n".join(parts[splits]) + "\n", encoding="utf-8")
    (folder / "test.txt").write_text("\n".join(parts[splits + 1]) + "\n", encoding="utf-8")
    return folder


def character_dictionary(folder: Path) -> Dictionary:
    """Every character of the corpus (and ``<unk>``)."""
    dictionary = Dictionary(add_unk=True)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            for char in sorted(set(path.read_text(encoding="utf-8"))):
                dictionary.add_item(char)
    return dictionary


def tiny_corpus(folder: Path, case_seed: int = 0, **options: int) -> TextCorpus:
    """A ``TextCorpus`` of :func:`write_tiny_corpus`'s files; flair flips the case of random lines of ``valid.txt``
    and ``test.txt`` as it reads them, with Python's generator seeded by ``case_seed``."""
    write_tiny_corpus(folder, **options)
    random.seed(case_seed)
    return TextCorpus(folder, character_dictionary(folder), forward=True, character_level=True)


def tiny_language_model(corpus: TextCorpus, seed: int = 1, dropout: float = 0.0) -> LanguageModel:
    """A forward character LSTM of 24 units (without dropout: N processes then train exactly as one)."""
    torch.manual_seed(seed)
    return LanguageModel(
        corpus.dictionary, is_forward_lm=True, hidden_size=24, nlayers=1, embedding_size=16, dropout=dropout
    )


def seeded(seed: int = 5) -> None:
    """The same generators before each of two runs that must match."""
    random.seed(seed)
    torch.manual_seed(seed)


def copy_model(model: LanguageModel) -> LanguageModel:
    """An independent copy with the same weights."""
    return copy.deepcopy(model)


def summaries(run: Path) -> list[str]:
    """The lines of ``loss.txt`` without their timings."""
    return [re.sub(r"time: +[0-9.]+s \| ", "", line) for line in (run / "loss.txt").read_text().splitlines()]


def validation_perplexities(run: Path) -> list[float]:
    """The validation perplexity of every line of ``loss.txt`` but the last (the test line)."""
    return [float(line.split("valid ppl")[1].split("|")[0]) for line in summaries(run)[:-1]]


def no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the job (building its Fabric, starting the ranks) fails the test at once: a refusal must come
    before."""

    def started(*args: Any, **kwargs: Any) -> None:
        pytest.fail("the run went on to build its Fabric or start its processes instead of refusing the arguments")

    monkeypatch.setattr(language_model_trainer, "run_job", started)
