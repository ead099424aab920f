"""What ``FabricLanguageModelTrainer`` refuses itself where Lightning's own checks would let a run through: on a CPU,
``16-true`` and DeepSpeed are refused earlier by the launch checks (CUDA only), so here the launch configuration a
GPU machine would resolve is stood in for, and the language-model trainer must refuse it before anything starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from flair.trainers.language_model_trainer import TextCorpus
from lightning.fabric.strategies import DeepSpeedStrategy

from flair_fabric import FabricLanguageModelTrainer
from flair_fabric.language_model import trainer as language_model_trainer

from .lm_support import LM_OPTIONS, no_process_may_start, tiny_corpus, tiny_language_model


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> TextCorpus:
    return tiny_corpus(tmp_path_factory.mktemp("lm-corpus"))


def _deepspeed_stage_2() -> DeepSpeedStrategy:
    """A DeepSpeedStrategy object (Lightning's constructor needs the deepspeed package, which is not installed)."""
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.config = {"zero_optimization": {"stage": 2}}
    return strategy


@pytest.mark.parametrize(
    ("resolved", "message"),
    [
        ({"precision": "16-true"}, r"\(16-true\) casts the whole model, .*: pass precision='32-true', 'bf16-mixed'"),
        ({"strategy": _deepspeed_stage_2()}, r"FabricLanguageModelTrainer trains with DDP \('ddp', "),
    ],
    ids=["16-true", "deepspeed"],
)
def test_what_a_gpu_machine_would_launch_is_refused_before_anything_starts(
    corpus: TextCorpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resolved: dict[str, Any], message: str
) -> None:
    make_launch_config = language_model_trainer.make_launch_config

    def on_a_gpu_machine(**kwargs: Any) -> Any:
        return dataclasses.replace(make_launch_config(**kwargs), **resolved)

    monkeypatch.setattr(language_model_trainer, "make_launch_config", on_a_gpu_machine)
    no_process_may_start(monkeypatch)
    options = {**LM_OPTIONS, "max_epochs": 1, "mini_batch_size": 2, "accelerator": "cpu", "devices": 1}
    with pytest.raises(ValueError, match=message):
        FabricLanguageModelTrainer(tiny_language_model(corpus), corpus).train(tmp_path / "run", **options)
    assert not (tmp_path / "run").exists()
