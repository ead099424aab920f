"""Training in spawned or forked workers: what a worker needs, what it hands back, and how the caller's model takes
it over, so that the caller's model ends as flair's trainer leaves a model (weights, eval mode, model card)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import flair
import torch
from flair.data import Corpus
from lightning.fabric import Fabric

from flair_fabric.state.safe_loading import as_plain_data
from flair_fabric.training.arguments import TrainArguments

if TYPE_CHECKING:
    from flair_fabric.trainer import FabricTrainer

log = logging.getLogger("flair")


@dataclass
class WorkerJob:
    """What a spawned or forked rank needs to run the training."""

    trainer_class: type[FabricTrainer]
    model: flair.nn.Model
    corpus: Corpus
    arguments: TrainArguments


@dataclass
class TrainedInWorker:
    """What the caller's model takes over from global rank 0's model after training in workers (plain data)."""

    result: dict
    weights: dict[str, torch.Tensor]
    training: bool
    model_card: dict | None

    def hand_to(self, model: flair.nn.Model) -> dict:
        """Give ``model`` the trained state; returns the run's return values."""
        model.load_state_dict(self.weights)
        model.model_card = self.model_card
        model.train(self.training)  # flair's trainer leaves it in eval mode
        return self.result


def train_in_worker(fabric: Fabric, job: WorkerJob) -> TrainedInWorker:
    """One spawned or forked rank: rebuild the trainer, train; return the results and the trained model's state."""
    trainer = job.trainer_class(job.model, job.corpus)
    result = trainer.train_on_rank(fabric, job.arguments)
    model = trainer.model
    weights = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return TrainedInWorker(as_plain_data(result), weights, model.training, as_plain_data(model.model_card))


def take_final_model_written_since(model: flair.nn.Model, base_path: Path, started: float) -> None:
    """After the workers were stopped at once: give ``model`` the weights of the final-model.pt they saved, if they
    got that far, and say which state the model is in."""
    final_model = base_path / "final-model.pt"
    if final_model.is_file() and final_model.stat().st_mtime >= started:
        model.load_state_dict(model.load(final_model).state_dict())
        model.eval()
        log.warning(f"the workers were stopped; the model holds the weights they saved in {final_model}")
    else:
        log.warning("the workers were stopped before they saved a model: the model was not updated")
