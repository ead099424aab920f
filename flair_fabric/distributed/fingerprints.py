"""Cheap fingerprints of a corpus and of a model, to check that every rank (and a resumed run) trains the same thing.

A corpus is fingerprinted by the size of each split and the text and labels of at most 256 evenly spaced data points
per split; a model by its class, the names, shapes and types of its parameters and buffers, and the items of every
flair ``Dictionary`` it holds (label dictionaries, embedding vocabularies), in order. Weights are not part of it:
they may differ before training starts (DDP and FSDP start every rank from rank 0's weights).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from flair.data import Corpus, DataPoint, Dictionary, _len_dataset
from lightning.fabric import Fabric
from torch.utils.data import Dataset

SAMPLED_DATA_POINTS = 256


def _crc(parts: Iterable[str]) -> str:
    checksum = 0
    for part in parts:
        checksum = zlib.crc32(part.encode("utf-8", errors="replace"), checksum)
    return f"{checksum:08x}"


def _data_point_text(data_point: DataPoint) -> str:
    labels = sorted(f"{label.data_point.unlabeled_identifier}={label.value}" for label in data_point.labels)
    return data_point.unlabeled_identifier + "\t" + "|".join(labels)


def split_fingerprint(data: Dataset | None) -> str:
    """Size and a checksum of evenly spaced data points of one split."""
    if data is None:
        return "none"
    size = _len_dataset(data)
    step = max(1, math.ceil(size / SAMPLED_DATA_POINTS))  # at most SAMPLED_DATA_POINTS built, however big the split
    return f"{size}:{_crc(_data_point_text(data[index]) for index in range(0, size, step))}"


def corpus_fingerprint(corpus: Corpus) -> dict[str, str]:
    """A fingerprint per split of ``corpus``."""
    return {split: split_fingerprint(getattr(corpus, split)) for split in ("train", "dev", "test")}


def _dictionaries(model: torch.nn.Module) -> Iterable[tuple[str, Dictionary]]:
    for module_name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if isinstance(value, Dictionary):
                yield f"{module_name}.{attribute}", value


def model_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """A fingerprint of ``model``'s structure and of its dictionaries (not of its weights)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    structure = _crc(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}" for name, tensor in tensors)
    fingerprint = {"class": type(model).__name__, "parameters": structure}
    for name, dictionary in _dictionaries(model):
        fingerprint[f"dictionary {name}"] = _crc(str(item) for item in dictionary.get_items())
    return fingerprint


def text_corpus_fingerprint(corpus: Any) -> dict[str, str]:
    """A fingerprint of a language-model ``TextCorpus``: its character dictionary, the names and sizes of its split
    files, and the sizes of its validation and test text (their content may differ: flair flips the case of random
    lines when it reads them)."""
    files = sorted(Path(name) for name in corpus.train.files)
    return {
        "dictionary": _crc(str(item) for item in corpus.dictionary.get_items()),
        "train": _crc(f"{path.name}:{path.stat().st_size}" for path in files),
        "valid, test": f"{len(corpus.valid)}:{len(corpus.test)}",
    }


def check_ranks_agree(fabric: Fabric, fingerprints: dict[str, dict[str, str]]) -> None:
    """Refuse to train when the ranks hold different data or differently built models: ``fingerprints`` (e.g.
    ``{"corpus": corpus_fingerprint(corpus), "model": model_fingerprint(model)}``) must equal global rank 0's.

    Every rank compares its fingerprints with global rank 0's (one ``all_gather_object``) and every rank raises the
    same error, so no rank is left waiting.
    """
    if fabric.world_size == 1:
        return
    every: list[Any] = [None] * fabric.world_size
    torch.distributed.all_gather_object(every, fingerprints)
    problems = [
        f"rank {rank}'s {kind} differs from rank 0's in {', '.join(differing)}"
        for rank, theirs in enumerate(every)
        for kind in fingerprints
        if (differing := differences(every[0][kind], theirs[kind]))
    ]
    if problems:
        raise ValueError(
            "the processes would not train the same thing: "
            + "; ".join(problems)
            + ". Build the corpus and the model the same way in every process: the same files and seeds, dictionaries"
            " and vocabularies from a fixed order (not from iterating a set), downloads finished before training."
        )


def differences(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """The keys whose fingerprints differ (or exist on one side only)."""
    return sorted(key for key in expected.keys() | actual.keys() if expected.get(key) != actual.get(key))
