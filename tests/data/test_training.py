"""flair's own ModelTrainer trains on a mapped corpus to the same weights as on flair's corpus in memory."""

from __future__ import annotations

from pathlib import Path

import flair
import pytest
import torch
from flair.embeddings import DocumentPoolEmbeddings, OneHotEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer

from flair_fabric.data import map_corpus
from flair_fabric.datasets import trec_corpus


def _train(
    corpus: flair.data.Corpus, folder: Path, shuffle: bool, embeddings: OneHotEmbeddings
) -> dict[str, torch.Tensor]:
    flair.set_seed(5)
    dictionary = corpus.make_label_dictionary("question_class")
    model = TextClassifier(DocumentPoolEmbeddings([embeddings]), "question_class", label_dictionary=dictionary)
    ModelTrainer(model, corpus).train(
        folder,
        max_epochs=2,
        mini_batch_size=16,
        learning_rate=0.5,
        shuffle=shuffle,
        save_final_model=False,
        create_file_logs=False,
        create_loss_file=False,
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
