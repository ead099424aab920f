"""LoRA adapters (peft) in flair's transformer embeddings, trained by FabricTrainer and checked against flair's own
ModelTrainer in one process and against peft's own merge: on 2 forked DDP ranks, with adapter weights that never get
a gradient (BERT's pooler), adapter-sized checkpoints resumed mid-epoch on another number of processes, and model
files that stock flair loads in a fresh process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from flair.data import Sentence
from flair.models import TextClassifier
from flair.trainers import ModelTrainer
from flair.trainers.plugins import TrainerPlugin

from flair_fabric import FabricTrainer
from flair_fabric.state.training_state import complete_checkpoints

from ..support import make_tiny_bert, small_trec
from .lora_support import (
    WITH_THE_POOLER,
    base_weights,
    lora_classifier,
    predict_in_a_fresh_process,
    pretrained_weights,
    trainable_weights,
)

pytestmark = pytest.mark.multiprocess

SIZES = {"train_size": 48, "dev_size": 8, "test_size": 8}
ARGUMENTS: dict[str, Any] = {  # train with AdamW: flair's fine_tune counts its schedule's steps differently on N ranks
    "optimizer": torch.optim.AdamW,
    "learning_rate": 5e-3,
    "mini_batch_size": 8,
    "max_epochs": 2,
    "use_final_model_for_eval": True,  # the final weights, not the best epoch's
    "embeddings_storage_mode": "none",
}
TWO_RANKS = {**{k: v for k, v in ARGUMENTS.items() if k != "mini_batch_size"}, "global_batch_size": 8}
TWO_RANKS.update(devices=2, strategy="ddp_fork")
POOLER = "embeddings.model.base_model.model.pooler.dense.lora_"


class _Buckets(TrainerPlugin):
    """Records on global rank 0 after set-up what DDP registered for its buckets (its own logging data)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    @TrainerPlugin.hook
    def after_setup(self, **kw: Any) -> None:
        ddp = self.trainer._run.module._forward_module
        data = ddp._get_ddp_logging_data()
        seen = {key: data[key] for key in ("num_parameter_tensors", "total_parameter_size_bytes")}
        (self.out / f"buckets-{self.trainer.global_rank}.json").write_text(json.dumps(seen))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """flair's ModelTrainer in one process; FabricTrainer in one process and on 2 forked ranks with a checkpoint every
    3 steps (6 an epoch); on 2 forked ranks resumed from the one-process run's checkpoint after step 3, and in one
    process from the 2-rank run's."""
    out = tmp_path_factory.mktemp("lora")
    corpus = small_trec(**SIZES)
    bert = make_tiny_bert(out / "bert", corpus)
    flair_model = lora_classifier(corpus, bert, WITH_THE_POOLER)
    ModelTrainer(flair_model, corpus).train(out / "flair", **ARGUMENTS)
    one = lora_classifier(corpus, bert, WITH_THE_POOLER)
    FabricTrainer(one, corpus).train(out / "one", checkpoint_every_n_steps=3, keep_checkpoints=10, **ARGUMENTS)
    two = lora_classifier(corpus, bert, WITH_THE_POOLER)
    every_3 = {"checkpoint_every_n_steps": 3, "keep_checkpoints": 10}
    FabricTrainer(two, corpus).train(out / "two", plugins=[_Buckets(out)], **TWO_RANKS, **every_3)
    mid_epoch = complete_checkpoints(out / "one")[0]
    assert mid_epoch.name == "step-000000003"
    shutil.copytree(mid_epoch, out / "resumed" / "checkpoints" / mid_epoch.name)
    resumed = lora_classifier(corpus, bert, WITH_THE_POOLER)
    FabricTrainer(resumed, corpus).train(out / "resumed", resume_from="auto", **TWO_RANKS)
    two_ranks_mid_epoch = complete_checkpoints(out / "two")[0]  # the pooler's adapter weights frozen by the probe
    shutil.copytree(two_ranks_mid_epoch, out / "back" / "checkpoints" / two_ranks_mid_epoch.name)
    back = lora_classifier(corpus, bert, WITH_THE_POOLER)
    FabricTrainer(back, corpus).train(out / "back", resume_from="auto", **ARGUMENTS)
    models = {"flair": flair_model, "one": one, "two": two, "resumed": resumed, "back": back}
    return {"out": out, "bert": bert, "corpus": corpus, "models": models, "checkpoint": mid_epoch}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], rtol=0, atol=atol, msg=f"{what}: {name}")


def test_lora_on_two_ranks_and_resumed_from_one_equals_flair_in_one_process(runs: dict[str, Any]) -> None:
    models = runs["models"]
    flair_trained = trainable_weights(models["flair"])
    assert any(".lora_A." in name for name in flair_trained) and any("decoder" in name for name in flair_trained)
    _close(trainable_weights(models["one"]), flair_trained, 0.0, "one process")
    for run in ("two", "resumed", "back"):  # the pooler's adapter weights, frozen by the probe, compared too
        _close({name: models[run].state_dict()[name] for name in flair_trained}, flair_trained, 1e-5, run)
    assert (models["flair"].state_dict()[f"{POOLER}B.default.weight"] == 0).all(), "never trained"
    pretrained = pretrained_weights(runs["bert"])
    for run, model in models.items():  # the frozen base is bit-equal to the pretrained model after every run
        base = base_weights(model)
        assert base.keys() == pretrained.keys()
        changed = [name for name, value in pretrained.items() if not torch.equal(base[name][: len(value)], value)]
        assert changed == [], run  # (flair adds a row to the word embeddings for its context marker)
    log = (runs["out"] / "resumed" / "training.log").read_text()
    assert "resuming a checkpoint of 1 process(es) on 2" in log
    assert "resuming a checkpoint of 2 process(es) on 1" in (runs["out"] / "back" / "training.log").read_text()


def test_adapter_weights_without_gradient_are_frozen_with_one_warning_not_an_unused_parameter_search(
    runs: dict[str, Any],
) -> None:
    for run in ("two", "resumed"):
        log = (runs["out"] / run / "training.log").read_text()
        warnings = [line for line in log.splitlines() if "adapter weight(s) get no gradient" in line]
        assert len(warnings) == 1, run
        assert "pooler.dense.lora_A.default.weight" in warnings[0] and "pooler.dense.lora_B" in warnings[0]
        assert "encoder.layer" not in warnings[0], "only the weights without gradient are named"
        assert "find_unused_parameters=False" in log, run


def test_ddp_registers_only_the_weights_that_train_for_its_buckets(runs: dict[str, Any]) -> None:
    model = runs["models"]["flair"]  # the adapters and the decoder, but the pooler's adapter weights (no gradient)
    training = [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith(POOLER)]
    for rank in (0, 1):
        seen = json.loads((runs["out"] / f"buckets-{rank}.json").read_text())
        assert seen["num_parameter_tensors"] == len(training)
        assert seen["total_parameter_size_bytes"] == sum(p.numel() * p.element_size() for p in training)


def test_a_checkpoint_holds_the_trainable_weights_and_their_optimizer_state_not_the_frozen_base(
    runs: dict[str, Any],
) -> None:
    stored = torch.load(runs["checkpoint"] / "state.ckpt", map_location="cpu", weights_only=True)
    model = runs["models"]["one"]
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    buffers = set(model.state_dict()) - {name for name, _ in model.named_parameters()}
    assert set(stored["model"]) == trainable | buffers
    assert not any(".base_layer." in name or "word_embeddings" in name for name in stored["model"])
    assert len(stored["optimizer"]["state"]) == len(trainable) - 2, "all but the pooler's two adapter weights"


def test_final_model_pt_loads_with_stock_flair_in_a_fresh_process_and_predicts_as_the_trained_model(
    runs: dict[str, Any],
) -> None:
    texts = [sentence.to_original_text() for sentence in runs["corpus"].test] + ["what is the capital of peru ?"]
    loaded = predict_in_a_fresh_process(runs["out"] / "two" / "final-model.pt", texts)
    assert loaded["imported"] == [], "neither flair-fabric nor peft"
    sentences = [Sentence(text) for text in texts]
    model = runs["models"]["two"]
    model.predict(sentences)
    assert loaded["labels"] == [sentence.get_label(model.label_type).value for sentence in sentences]


def test_the_model_file_holds_the_weights_of_peft_s_own_merge(runs: dict[str, Any]) -> None:
    model = runs["models"]["two"]
    merged = TextClassifier.load(runs["out"] / "two" / "final-model.pt").state_dict()
    reference = model.embeddings.model
    unmerged = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    reference.merge_adapter()  # peft's own merge, undone afterwards
    try:
        base = reference.get_base_model().state_dict()
        expected = {f"embeddings.model.{name}": tensor.clone() for name, tensor in base.items()}
    finally:
        reference.unmerge_adapter()
    expected = {name.replace(".base_layer.", "."): t for name, t in expected.items() if ".lora_" not in name}
    expected.update({name: t for name, t in model.state_dict().items() if not name.startswith("embeddings.model.")})
    _close(merged, expected, 0.0, "merged")
    assert all(torch.allclose(unmerged[name], t) for name, t in reference.state_dict().items())
