"""flair's own ModelTrainer, and FabricTrainer in one process, train on a mapped corpus to the same weights as flair's
ModelTrainer on flair's corpus in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flair
import pytest
import torch
from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer

from flair_fabric import FabricTrainer
from flair_fabric.data import MappedSplit, map_corpus
from flair_fabric.datasets import trec_corpus


def _train(
    corpus: flair.data.Corpus,
    folder: Path,
    shuffle: bool,
    embeddings: OneHotEmbeddings,
    trainer: type[ModelTrainer] = ModelTrainer,
    **launch: Any,
) -> dict[str, torch.Tensor]:
    flair.set_seed(5)
    dictionary = corpus.make_label_dictionary("question_class")
    model = TextClassifier(DocumentPoolEmbeddings([embeddings]), "question_class", label_dictionary=dictionary)
    trainer(model, corpus).train(
        folder,
        max_epochs=2,
        mini_batch_size=16,
        learning_rate=0.5,
        shuffle=shuffle,
        save_final_model=False,
        create_file_logs=False,
        create_loss_file=False,
        **launch,
    )
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_flairs_model_trainer_trains_to_the_same_weights_on_the_mapped_corpus(tmp_path: Path, shuffle: bool) -> None:
    flair.device = torch.device("cpu")
    corpus = trec_corpus(train_size=400, dev_size=40, test_size=40)
    mapped = map_corpus(corpus, cache_folder=tmp_path / "cache")
    flair.set_seed(5)
    reference_embeddings = OneHotEmbeddings.from_corpus(corpus, min_freq=2, embedding_length=8)
    flair.set_seed(5)
    mapped_embeddings = mapped.one_hot_embeddings(min_freq=2, embedding_length=8)
    reference = _train(corpus, tmp_path / "memory", shuffle, reference_embeddings)
    ours = _train(mapped, tmp_path / "mapped", shuffle, mapped_embeddings)
    assert reference.keys() == ours.keys()
    for name in reference:
        assert torch.equal(reference[name], ours[name]), name


class CountingSplit(MappedSplit):
    """A mapped split that counts the data points it builds."""

    built = 0

    def __getitem__(self, index: int) -> Any:
        CountingSplit.built += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_fabric_trainer_in_one_process_trains_on_the_mapped_corpus_as_flair_on_the_corpus_in_memory(
    tmp_path: Path, shuffle: bool
) -> None:
    """Bit-equal to flair's ModelTrainer on flair's corpus in memory (the same shuffled order drawn); each training
    data point is built once per epoch, and the set-up builds a bounded sample (the corpus fingerprint's at most 256
    per split, the probe batch), never the whole split."""
    flair.device = torch.device("cpu")
    corpus = trec_corpus(train_size=400, dev_size=40, test_size=40)
    mapped = map_corpus(corpus, cache_folder=tmp_path / "cache")
    flair.set_seed(5)
    words = OneHotEmbeddings.from_corpus(corpus, min_freq=2, embedding_length=8)
    reference = _train(corpus, tmp_path / "memory", shuffle, words)
    mapped._train = CountingSplit(**mapped.train.__getstate__())  # the same stored split, its reads counted
    CountingSplit.built = 0
    flair.set_seed(5)
    embeddings = mapped.one_hot_embeddings(min_freq=2, embedding_length=8)
    ours = _train(mapped, tmp_path / "fabric", shuffle, embeddings, FabricTrainer, accelerator="cpu", devices=1)
    assert reference.keys() == ours.keys()
    for name in reference:
        assert torch.equal(reference[name], ours[name]), name
    assert 2 * 400 <= CountingSplit.built < 2 * 400 + 300, "two epochs, and the set-up's bounded sample"
