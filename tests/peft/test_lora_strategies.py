"""LoRA adapters under FSDP (2 forked ranks) and ddp_spawn (2 spawned ranks, the model moved to the workers), and from
a config file (``peft_config`` as a ``class_path``), each against flair's ModelTrainer or the equivalent script; the
run's own best-model.pt loaded back into the adapted model for the final test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flair
import pytest
import torch
import yaml
from flair.data import Sentence
from flair.embeddings import TransformerDocumentEmbeddings
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin
from peft import LoraConfig

from flair_fabric import FabricTrainer, FlairFSDPStrategy
from flair_fabric.datasets import TREC, TREC_LABEL_TYPE
from flair_fabric.shell.command import train
from flair_fabric.state.adapters import has_adapters

from ..support import make_tiny_bert, small_trec
from .lora_support import base_weights, lora_classifier, pretrained_weights, trainable_weights

pytestmark = pytest.mark.multiprocess

SIZES = {"train_size": 32, "dev_size": 8, "test_size": 8}
QUERY_VALUE = ["query", "value"]
ONE = {"optimizer": torch.optim.AdamW, "learning_rate": 5e-3, "mini_batch_size": 8, "max_epochs": 2}
TWO = {**{k: v for k, v in ONE.items() if k != "mini_batch_size"}, "global_batch_size": 8, "devices": 2}


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lora_strategies")
    corpus = small_trec(**SIZES)
    bert = make_tiny_bert(out / "bert", corpus)
    flair_model = lora_classifier(corpus, bert, QUERY_VALUE)
    ModelTrainer(flair_model, corpus).train(out / "flair", use_final_model_for_eval=True, **ONE)
    return {"out": out, "corpus": corpus, "bert": bert, "flair": flair_model}


def _labels(model: TextClassifier, texts: list[str]) -> list[str]:
    sentences = [Sentence(text) for text in texts]
    model.predict(sentences)
    return [sentence.get_label(model.label_type).value for sentence in sentences]


def test_fsdp_trains_lora_like_flair_in_one_process_and_keeps_the_base(setting: dict[str, Any]) -> None:
    corpus, bert = setting["corpus"], setting["bert"]
    model = lora_classifier(corpus, bert, QUERY_VALUE)
    fsdp = FlairFSDPStrategy(start_method="fork")
    FabricTrainer(model, corpus).train(setting["out"] / "fsdp", strategy=fsdp, use_final_model_for_eval=True, **TWO)
    expected = trainable_weights(setting["flair"])
    trained = model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5, msg=name)
    pretrained, base = pretrained_weights(bert), base_weights(model)
    assert [name for name, value in pretrained.items() if not torch.equal(base[name][: len(value)], value)] == []
    loaded = TextClassifier.load(setting["out"] / "fsdp" / "final-model.pt")
    assert not has_adapters(loaded)
    texts = [sentence.to_original_text() for sentence in corpus.test]
    assert _labels(loaded, texts) == _labels(model, texts)


def _merged_by_peft(model: TextClassifier) -> dict[str, torch.Tensor]:
    """peft's own merge of ``model``'s adapters (undone afterwards), under the plain model's names."""
    peft_model = model.embeddings.model
    peft_model.merge_adapter()
    try:
        merged = {f"embeddings.model.{k}": t.clone() for k, t in peft_model.get_base_model().state_dict().items()}
    finally:
        peft_model.unmerge_adapter()
    merged = {name.replace(".base_layer.", "."): t for name, t in merged.items() if ".lora_" not in name}
    return {**merged, **{k: t for k, t in model.state_dict().items() if not k.startswith("embeddings.model.")}}


def test_ddp_spawn_moves_the_adapters_to_the_workers_and_tests_with_the_best_model_it_wrote(
    setting: dict[str, Any],
) -> None:
    corpus, bert, out = setting["corpus"], setting["bert"], setting["out"]
    model = lora_classifier(corpus, bert, QUERY_VALUE)
    FabricTrainer(model, corpus).train(out / "spawn", strategy="ddp_spawn", **TWO)  # tests with best-model.pt
    final = TextClassifier.load(out / "spawn" / "final-model.pt").state_dict()
    expected = _merged_by_peft(setting["flair"])
    assert final.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-5, msg=name)
    # the final test with best-model.pt (flair's default): the file's merged weights go back into the adapted model
    assert "Loading model from best epoch" in (out / "spawn" / "training.log").read_text()
    lora_b = [t for name, t in model.state_dict().items() if ".lora_B." in name]
    assert has_adapters(model) and lora_b and all((t == 0).all() for t in lora_b), "merged into the base"
    texts = [sentence.to_original_text() for sentence in corpus.test] + ["who painted the mona lisa ?"]
    assert _labels(model, texts) == _labels(TextClassifier.load(out / "spawn" / "best-model.pt"), texts)


def _script(bert: Path, base_path: Path) -> None:
    """What the config below says, written as a script."""
    flair.set_seed(7)
    corpus = TREC(**SIZES)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=QUERY_VALUE)
    embeddings = TransformerDocumentEmbeddings(str(bert), fine_tune=True, peft_config=config)
    labels = corpus.make_label_dictionary(TREC_LABEL_TYPE, add_unk=False)
    model = TextClassifier(embeddings, label_type=TREC_LABEL_TYPE, label_dictionary=labels)
    FabricTrainer(model, corpus).train(base_path, use_final_model_for_eval=True, accelerator="cpu", **ONE)


def test_a_config_with_a_peft_config_class_trains_the_weights_of_the_equivalent_script(
    setting: dict[str, Any], tmp_path: Path
) -> None:
    lora = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": QUERY_VALUE}
    embeddings = {"model": str(setting["bert"]), "fine_tune": True}
    config = {
        "seed": 7,
        "corpus": {"class_path": "flair_fabric.datasets.TREC", "init_args": SIZES},
        "embeddings": {
            "class_path": "flair.embeddings.TransformerDocumentEmbeddings",
            "init_args": {**embeddings, "peft_config": {"class_path": "peft.LoraConfig", "init_args": lora}},
        },
        "model": {"class_path": "flair.models.TextClassifier", "init_args": {"label_type": TREC_LABEL_TYPE}},
        "trainer": {
            "method": "train",
            "base_path": str(tmp_path / "config"),
            "optimizer": "torch.optim.AdamW",
            **{k: v for k, v in ONE.items() if k != "optimizer"},
            "use_final_model_for_eval": True,
            "accelerator": "cpu",
            "devices": 1,
        },
    }
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(config))
    train([str(tmp_path / "lora.yaml")])
    _script(setting["bert"], tmp_path / "script")
    from_config = TextClassifier.load(tmp_path / "config" / "final-model.pt").state_dict()  # stock flair loads it
    script = TextClassifier.load(tmp_path / "script" / "final-model.pt").state_dict()
    assert from_config.keys() == script.keys() and any(".query." in name for name in script)
    assert all(torch.equal(value, from_config[name]) for name, value in script.items())
    assert "LoraModel" in (tmp_path / "config" / "training.log").read_text(), "trained with the adapters"


class _Checkpointing(TrainerPlugin):
    """Records, on every rank after set-up, whether the trained model's gradient checkpointing is reentrant."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    @TrainerPlugin.hook
    def after_setup(self, **kw: Any) -> None:
        functions = [getattr(m, "_gradient_checkpointing_func", None) for m in self.trainer.model.modules()]
        reentrant = [f.keywords.get("use_reentrant", True) for f in functions if f is not None]
        (self.out / f"reentrant-{self.trainer.global_rank}.json").write_text(json.dumps(reentrant))


@pytest.mark.parametrize("strategy", ["ddp_fork_find_unused_parameters_true", "fsdp"])
def test_gradient_checkpointing_is_non_reentrant_under_ddp_and_in_fsdps_copy(
    setting: dict[str, Any], tmp_path: Path, strategy: str
) -> None:
    """DDP where a reentrant backward marks weights ready twice; FSDP, whose copy of the model is rebuilt without
    the caller's gradient checkpointing."""
    corpus, bert = setting["corpus"], setting["bert"]

    def checkpointed() -> TextClassifier:
        model = lora_classifier(corpus, bert, QUERY_VALUE)
        model.embeddings.model.get_base_model().gradient_checkpointing_enable()  # reentrant, as peft's kbit set-up
        model.embeddings.model.enable_input_require_grads()
        return model

    reference = checkpointed()
    ModelTrainer(reference, corpus).train(tmp_path / "flair", use_final_model_for_eval=True, **ONE)
    model = checkpointed()
    chosen = FlairFSDPStrategy(start_method="fork") if strategy == "fsdp" else strategy
    try:
        options = {**TWO, "strategy": chosen, "plugins": [_Checkpointing(tmp_path)], "use_final_model_for_eval": True}
        FabricTrainer(model, corpus).train(tmp_path / "run", **options)
    finally:  # what the ranks trained with, also where a rank failed
        seen = [json.loads((tmp_path / f"reentrant-{rank}.json").read_text()) for rank in (0, 1)]
        assert all(rank and not any(rank) for rank in seen), seen
    for name, value in trainable_weights(reference).items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-5, msg=name)
