"""The language-model trainer as a job of the runner (:mod:`flair_fabric.launch.runner`): the loop on every rank, and,
after spawned or forked workers, the caller's model given global rank 0's trained weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from lightning.fabric import Fabric

from flair_fabric.language_model.arguments import LanguageModelArguments
from flair_fabric.language_model.loop import LanguageModelRun, LanguageModelTrainerSide
from flair_fabric.language_model.recurrent_kernels import recurrent_kernels
from flair_fabric.launch.runner import Job


@dataclass
class TrainedLanguageModel:
    """Global rank 0's model at the end, for the caller's model (plain data)."""

    weights: dict[str, torch.Tensor]
    training: bool


class LanguageModelJob(Job):
    """The caller's trainer (model, corpus, flair's resume state) trained on every rank; spawned workers receive it by
    its flair state, forked ones inherit it, and rank 0 returns the trained weights."""

    result_types: ClassVar[tuple[type, ...]] = (TrainedLanguageModel,)

    def __init__(self, trainer: LanguageModelTrainerSide, arguments: LanguageModelArguments) -> None:
        super().__init__()
        self.trainer, self.arguments = trainer, arguments
        self.in_workers = False

    def for_workers(self) -> Job:
        copy = LanguageModelJob(self.trainer, self.arguments)
        copy.in_workers = True
        return copy

    def run_on_rank(self, fabric: Fabric) -> TrainedLanguageModel | None:
        with recurrent_kernels(fabric):
            LanguageModelRun(self.trainer, fabric, self.arguments, self.position).run()
        if not self.in_workers:
            return None
        model = self.trainer.model
        return TrainedLanguageModel({name: t.detach().cpu() for name, t in model.state_dict().items()}, model.training)

    def hand_back(self, result: Any) -> None:
        assert isinstance(result, TrainedLanguageModel)
        self.trainer.model.load_state_dict(result.weights)
        self.trainer.model.train(result.training)
