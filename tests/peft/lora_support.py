"""A tiny BERT text classifier with LoRA adapters, and the fresh process that loads its model file with flair alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import flair
import torch
from flair.data import Corpus
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from peft import LoraConfig

from flair_fabric.datasets import TREC_LABEL_TYPE

LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}
WITH_THE_POOLER = ["query", "value", "dense"]
"""``dense`` also matches BERT's pooler, which flair never uses: its adapter weights get no gradient."""


def lora_classifier(corpus: Corpus, bert_dir: str | Path, target_modules: list[str], seed: int = 7) -> TextClassifier:
    """A text classifier on the tiny BERT with LoRA adapters (no dropout) on ``target_modules``."""
    flair.set_seed(seed)
    config = LoraConfig(target_modules=target_modules, **LORA)
    embeddings = TransformerDocumentEmbeddings(str(bert_dir), fine_tune=True, peft_config=config)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    return TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)


def pretrained_weights(bert_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tiny BERT's own weights, as saved (the reference for frozen weights)."""
    from transformers import AutoModel

    return {name: tensor.clone() for name, tensor in AutoModel.from_pretrained(str(bert_dir)).state_dict().items()}


def base_weights(model: TextClassifier) -> dict[str, torch.Tensor]:
    """The adapted transformer's frozen base weights, under the pretrained model's names."""
    return {
        name.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor
        for name, tensor in model.embeddings.model.state_dict().items()
        if "lora_" not in name
    }


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a LoRA run trains: the adapters' and the decoder's."""
    state = model.state_dict()
    return {name: state[name] for name, parameter in model.named_parameters() if parameter.requires_grad}


FRESH_PROCESS = """
import json, sys
import flair
from flair.data import Sentence
from flair.models import TextClassifier
model = TextClassifier.load(sys.argv[1])
sentences = [Sentence(text) for text in json.loads(sys.argv[2])]
model.predict(sentences)
imported = sorted(name for name in ("flair_fabric", "peft") if name in sys.modules)
print(json.dumps({"labels": [s.get_label(model.label_type).value for s in sentences], "imported": imported}))
"""


def predict_in_a_fresh_process(model_file: Path, texts: list[str]) -> dict[str, Any]:
    """Load ``model_file`` with stock flair in a new interpreter (nothing of flair-fabric imported) and predict."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(model_file), json.dumps(texts)],
        capture_output=True,
        text=True,
        timeout=240,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
