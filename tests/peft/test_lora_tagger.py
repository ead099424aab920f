"""A sequence tagger on transformer word embeddings with LoRA adapters: its model file loads with stock flair's
``SequenceTagger.load`` (the adapters merged) and tags as the trained model tags."""

from __future__ import annotations

from pathlib import Path

import flair
import torch
from flair.data import Sentence
from flair.embeddings import TransformerWordEmbeddings
from flair.models import SequenceTagger
from peft import LoraConfig

from flair_fabric import FabricTrainer
from flair_fabric.datasets import WNUT16_LABEL_TYPE
from flair_fabric.state.adapters import has_adapters

from ..support import make_tiny_bert, small_wnut


def _tags(model: SequenceTagger, texts: list[str]) -> list[list[str]]:
    sentences = [Sentence(text) for text in texts]
    model.predict(sentences)
    return [[token.get_label(WNUT16_LABEL_TYPE).value for token in sentence] for sentence in sentences]


def test_a_lora_tagger_file_loads_with_stock_flair_and_tags_as_the_trained_model(tmp_path: Path) -> None:
    corpus = small_wnut(tmp_path / "wnut", train_size=16, dev_size=4, test_size=4)
    bert = make_tiny_bert(tmp_path / "bert", corpus)
    flair.set_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"])
    embeddings = TransformerWordEmbeddings(str(bert), fine_tune=True, peft_config=config)
    tags = corpus.make_label_dictionary(WNUT16_LABEL_TYPE, add_unk=False, add_dev_test=True)
    model = SequenceTagger(
        hidden_size=8, embeddings=embeddings, tag_dictionary=tags, tag_type=WNUT16_LABEL_TYPE, use_rnn=False
    )
    options = {"optimizer": torch.optim.AdamW, "learning_rate": 0.05, "mini_batch_size": 4, "max_epochs": 1}
    FabricTrainer(model, corpus).train(tmp_path / "run", use_final_model_for_eval=True, **options)
    loaded = SequenceTagger.load(tmp_path / "run" / "final-model.pt")
    assert not has_adapters(loaded) and has_adapters(model)
    texts = [sentence.to_original_text() for sentence in corpus.test] + ["new york is big"]
    assert _tags(loaded, texts) == _tags(model, texts)
