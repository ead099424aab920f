"""``FabricLanguageModelTrainer``: flair's ``LanguageModelTrainer`` (Flair embeddings) trained through Lightning
Fabric on one or many devices, through the same launch path, launch checks and hand-back as ``FabricTrainer``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flair.models import LanguageModel
from flair.trainers.language_model_trainer import LanguageModelTrainer, TextCorpus
from lightning.fabric import Fabric
from torch.optim import Optimizer
from torch.optim.sgd import SGD

from flair_fabric.language_model.arguments import LanguageModelArguments
from flair_fabric.language_model.columns import check_enough_text
from flair_fabric.language_model.loop import LanguageModelRun
from flair_fabric.language_model.recurrent_kernels import recurrent_kernels
from flair_fabric.language_model.resume import resume_file
from flair_fabric.launch.config import build_fabric, make_launch_config
from flair_fabric.launch.environment import restarted_by_torchrun
from flair_fabric.launch.workers import run_on_every_rank, starts_workers
from flair_fabric.state.model_files import check_writable_folder
from flair_fabric.state.training_state import rng_state
from flair_fabric.strategies import keeps_whole_model
from flair_fabric.strategies.ddp import FlairDDPStrategy


@dataclass
class LanguageModelJob:
    """What a spawned or forked rank needs: the trainer as the caller built it (model, corpus, flair's resume state),
    and the run's arguments."""

    trainer: FabricLanguageModelTrainer
    arguments: LanguageModelArguments


@dataclass
class TrainedLanguageModel:
    """Global rank 0's model at the end, for the caller's model (plain data)."""

    weights: dict[str, torch.Tensor]
    training: bool


TRAINABLE_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
"""Fabric precisions a LanguageModel trains in: the ones that leave its parameters as they are (every "-true"
precision but 32-true converts the whole model)."""


class FabricLanguageModelTrainer(LanguageModelTrainer):
    """flair's :class:`~flair.trainers.language_model_trainer.LanguageModelTrainer` on one or many devices.

    ``train`` takes flair's arguments unchanged (``mini_batch_size`` per process) plus ``accelerator``, ``devices``,
    ``num_nodes``, ``strategy`` (the DDP family), ``precision``, ``resume_from`` and ``collective_timeout``. ``N``
    processes with ``mini_batch_size=b`` train as one process with ``N·b`` (see
    :mod:`flair_fabric.language_model.columns`).
    """

    def train(
        self,
        base_path: Path | str,
        sequence_length: int,
        learning_rate: float = 20,
        mini_batch_size: int = 100,
        anneal_factor: float = 0.25,
        patience: int = 10,
        clip: float = 0.25,
        max_epochs: int = 1000,
        checkpoint: bool = False,
        grow_to_sequence_length: int = 0,
        num_workers: int = 2,
        use_amp: bool = False,
        *,
        accelerator: str = "auto",
        devices: Any = "auto",
        num_nodes: int = 1,
        strategy: Any = "auto",
        precision: str | int | None = None,
        resume_from: str | Path | None = None,
        collective_timeout: Any = None,
        **kwargs: Any,
    ) -> None:
        """flair's ``train``; see the class docstring for the added arguments. ``resume_from``: ``"auto"`` (the
        run's own ``lm-checkpoint.pt``, if any), a run folder or a state file written with ``checkpoint=True``."""
        generators = rng_state()  # before the launch draws anything: N processes read the text as one does
        for name, value in (("sequence_length", sequence_length), ("mini_batch_size", mini_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not valid: pass a positive whole number.")
        launch = make_launch_config(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            strategy=strategy,
            precision=precision,
            use_amp=use_amp,
            collective_timeout=collective_timeout,
        )
        if not keeps_whole_model(launch.strategy):
            raise ValueError(
                f"strategy={strategy!r}: FabricLanguageModelTrainer trains with DDP ('ddp', 'ddp_spawn', 'ddp_fork',"
                " 'ddp_notebook' or 'auto'); a character language model fits on every device."
            )
        if launch.precision not in TRAINABLE_PRECISIONS:
            raise ValueError(
                f"precision={precision!r} ({launch.precision}) casts the whole model, which flair's LanguageModel"
                " cannot be (its _apply returns None, so .to(dtype) gives None): pass precision='32-true',"
                " 'bf16-mixed' or, on a GPU, '16-mixed'."
            )
        base = Path(base_path)
        check_writable_folder(base)
        if resume_from is None and restarted_by_torchrun():
            resume_from = "auto"
        arguments = LanguageModelArguments(
            base_path=base,
            sequence_length=sequence_length,
            learning_rate=learning_rate,
            mini_batch_size=mini_batch_size,
            anneal_factor=anneal_factor,
            patience=patience,
            clip=clip,
            max_epochs=max_epochs,
            checkpoint=checkpoint,
            grow_to_sequence_length=grow_to_sequence_length,
            num_workers=num_workers,
            launch=launch,
            optimizer_options=dict(kwargs),
            resume_file=resume_file(resume_from, base),
            generators=generators,
        )
        self._check_corpus(arguments)
        fabric = build_fabric(launch)
        if isinstance(fabric.strategy, FlairDDPStrategy) and fabric.strategy.find_unused_parameters == "auto":
            fabric.strategy.find_unused_parameters = False  # every parameter of a LanguageModel gets a gradient
        if not starts_workers(fabric):
            run_on_every_rank(fabric, self.train_on_rank, arguments, launch.collective_timeout)
            return
        job = LanguageModelJob(self, arguments)
        trained = run_on_every_rank(
            fabric, train_in_worker, job, launch.collective_timeout, result_types=[TrainedLanguageModel]
        )
        self.model.load_state_dict(trained.weights)
        self.model.train(trained.training)

    def _check_corpus(self, arguments: LanguageModelArguments) -> None:
        """Refuse, before any process starts, a corpus that cannot fill every column of every process."""
        a, corpus = arguments, self.corpus
        world_size = a.launch.world_size
        if len(corpus.train) == 0:
            raise ValueError(f"the corpus has no training text: put one or more split files into {corpus.train.path}.")
        for what, text in (("validation split (valid.txt)", corpus.valid), ("test split (test.txt)", corpus.test)):
            check_enough_text(len(text), a.global_batch, what, a.mini_batch_size, world_size)
        for split_file in corpus.train.files:
            size = Path(split_file).stat().st_size  # bytes: at least as many as characters
            check_enough_text(size, a.global_batch, f"train split {split_file}", a.mini_batch_size, world_size)

    def train_on_rank(self, fabric: Fabric, arguments: LanguageModelArguments) -> None:
        """The training on one rank (called by the launch path)."""
        with recurrent_kernels(fabric):
            LanguageModelRun(self, fabric, arguments).run()

    @staticmethod
    def load_checkpoint(
        checkpoint_file: str | Path, corpus: TextCorpus, optimizer: type[Optimizer] = SGD
    ) -> FabricLanguageModelTrainer:
        """flair's ``load_checkpoint`` (``checkpoint.pt``, flair's meaning), giving this trainer."""
        checkpoint = LanguageModel.load_checkpoint(Path(checkpoint_file))
        return FabricLanguageModelTrainer(
            checkpoint["model"],
            corpus,
            optimizer,
            epoch=checkpoint["epoch"],
            split=checkpoint["split"],
            loss=checkpoint["loss"],
            optimizer_state=checkpoint["optimizer_state_dict"],
            scaler_state=checkpoint.get("scaler_state_dict"),
        )


def train_in_worker(fabric: Fabric, job: LanguageModelJob) -> TrainedLanguageModel:
    """One spawned or forked rank: train its copy of the caller's trainer; return the trained weights."""
    trainer = job.trainer  # forked: inherited; spawned: unpickled
    trainer.train_on_rank(fabric, job.arguments)
    weights = {name: tensor.detach().cpu() for name, tensor in trainer.model.state_dict().items()}
    return TrainedLanguageModel(weights, trainer.model.training)
