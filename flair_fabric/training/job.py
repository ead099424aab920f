"""Training as a job of the runner (:mod:`flair_fabric.launch.runner`): flair's loop on every rank, and, after spawned
or forked workers, the caller's model given what global rank 0's model is at the end (weights, eval mode, model card),
as flair's trainer leaves a model."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import flair
import torch
from flair.data import Corpus
from lightning.fabric import Fabric

from flair_fabric.distributed.stalls import Position
from flair_fabric.launch.runner import Job
from flair_fabric.state.adapter_files import check_save_adapters
from flair_fabric.state.adapters import check_adapters, mark_merged_bases, merged_bases
from flair_fabric.state.safe_loading import as_plain_data
from flair_fabric.training.arguments import TrainArguments
from flair_fabric.training.checkpointing import Preempted
from flair_fabric.training.interface import FlairTrainer
from flair_fabric.training.run import TrainingRun

log = logging.getLogger("flair")


class RunsOnRanks(FlairTrainer, Protocol):
    """A trainer that keeps the run it is in (its rank properties and model files serve plugins during the run)."""

    def attach_run(self, fabric: Fabric, run: TrainingRun | None) -> None:
        """Remember the rank's Fabric and the run (``None``: the run is over; Fabric is kept for the rank)."""


@dataclass
class TrainedInWorker:
    """What the caller's model takes over from global rank 0's model after training in workers (plain data)."""

    result: dict
    weights: dict[str, torch.Tensor]
    training: bool
    model_card: dict | None
    merged_bases: list[str] = field(default_factory=list)
    """The adapted embeddings whose base holds a model file's merged weights (``save_adapters`` writes no folder)."""

    def hand_to(self, model: flair.nn.Model) -> dict:
        """Give ``model`` the trained state; returns the run's return values."""
        model.load_state_dict(self.weights)
        mark_merged_bases(model, self.merged_bases)
        model.model_card = self.model_card
        model.train(self.training)  # flair's trainer leaves it in eval mode
        return self.result


def train_on_rank(trainer: RunsOnRanks, fabric: Fabric, arguments: TrainArguments, position: Position) -> dict:
    """flair's ``train_custom`` on one rank; every rank returns global rank 0's return values. A preempted run ends
    with the requeue exit code after its checkpoint."""
    run = TrainingRun(trainer, fabric, arguments, position)
    trainer.attach_run(fabric, run)
    try:
        return run.run()
    except Preempted as preempted:
        raise SystemExit(run.checkpointing.requeue(str(preempted))) from None
    finally:
        trainer.attach_run(fabric, None)


class TrainingJob(Job):
    """The caller's trainer trained on every rank; with workers, they train copies (:class:`TrainingInWorkers`)."""

    result_types: ClassVar[tuple[type, ...]] = (TrainedInWorker,)

    def __init__(self, trainer: RunsOnRanks, arguments: TrainArguments) -> None:
        super().__init__()
        check_adapters(trainer.model)  # before launch: adapters whose model files cannot be written (docs/peft.md)
        check_save_adapters(trainer.model, arguments.save_adapters)
        self.trainer, self.arguments = trainer, arguments
        self.preemption_signal = arguments.checkpoints.requeue_signal
        self.started = time.time()

    def run_on_rank(self, fabric: Fabric) -> dict:
        return train_on_rank(self.trainer, fabric, self.arguments, self.position)

    def for_workers(self) -> Job:
        return TrainingInWorkers(type(self.trainer), self.trainer.model, self.trainer.corpus, self.arguments)

    def hand_back(self, result: Any) -> dict:
        assert isinstance(result, TrainedInWorker)
        return result.hand_to(self.trainer.model)

    def stopped(self) -> None:
        take_final_model_written_since(self.trainer.model, self.arguments.flair.base_path, self.started)


class TrainingInWorkers(Job):
    """What a spawned or forked worker runs: a trainer of the caller's class rebuilt around the model and corpus it
    received, trained; global rank 0 returns the results and the trained model's state."""

    def __init__(self, trainer_class: type, model: flair.nn.Model, corpus: Corpus, arguments: TrainArguments) -> None:
        super().__init__()
        self.trainer_class, self.model, self.corpus, self.arguments = trainer_class, model, corpus, arguments
        self.preemption_signal = arguments.checkpoints.requeue_signal

    def run_on_rank(self, fabric: Fabric) -> TrainedInWorker:
        trainer = self.trainer_class(self.model, self.corpus)
        trained = trained_state(trainer, train_on_rank(trainer, fabric, self.arguments, self.position))
        trained.merged_bases = merged_bases(trainer.model)  # its adapters no longer give it (save_adapters)
        return trained


def trained_state(trainer: RunsOnRanks, result: dict) -> TrainedInWorker:
    """What the caller's model takes over from ``trainer``'s trained model, with the run's ``result`` (plain data)."""
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
