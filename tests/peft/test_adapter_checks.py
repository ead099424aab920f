"""Adapters whose model files flair-fabric cannot write as plain flair models are refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import flair
import pytest
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from peft import LoraConfig

from flair_fabric import FabricTrainer
from flair_fabric.datasets import TREC_LABEL_TYPE

from ..support import make_tiny_bert, no_training_may_start, small_trec


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"target_modules": ["query"], "use_dora": True}, "DoRA"),
        ({"target_modules": ["position_embeddings"]}, "not a LoRA Linear layer"),
        ({"target_modules": ["query"], "modules_to_save": ["pooler"]}, "modules_to_save"),
    ],
    ids=["dora", "an-embedding", "modules-to-save"],
)
def test_adapters_that_cannot_be_merged_into_a_flair_file_are_refused_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict, named: str
) -> None:
    corpus = small_trec(train_size=8, dev_size=2, test_size=2)
    bert = make_tiny_bert(tmp_path / "bert", corpus)
    flair.set_seed(1)
    embeddings = TransformerDocumentEmbeddings(str(bert), fine_tune=True, peft_config=LoraConfig(r=2, **options))
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    model = TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)
    no_training_may_start(monkeypatch)
    with pytest.raises(ValueError, match=rf"peft_config: .*{named}"):
        FabricTrainer(model, corpus).train(tmp_path / "run", max_epochs=1)
    assert not (tmp_path / "run" / "training.log").exists()
