"""``FabricLanguageModelTrainer``: flair's ``LanguageModelTrainer`` (Flair embeddings) trained through Lightning
Fabric on one or many devices, through the same launch path, launch checks and hand-back as ``FabricTrainer``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flair.models import LanguageModel
from flair.trainers.language_model_trainer import LanguageModelTrainer, TextCorpus
from torch.optim import Optimizer
from torch.optim.sgd import SGD

from flair_fabric.language_model.arguments import LanguageModelArguments
from flair_fabric.language_model.columns import check_enough_text
from flair_fabric.language_model.job import LanguageModelJob
from flair_fabric.launch.arguments import take_lightning_arguments, takes_lightning_arguments
from flair_fabric.launch.config import make_launch_config
from flair_fabric.launch.environment import restarted_by_torchrun
from flair_fabric.launch.runner import run_job
from flair_fabric.state.model_files import check_writable_folder
from flair_fabric.state.training_state import checkpoint_to_resume, rng_state
from flair_fabric.storage import is_url
from flair_fabric.strategies import every_parameter_learns, keeps_whole_model

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

    @takes_lightning_arguments
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
        resume_from: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        """flair's ``train``; see the class docstring for the added arguments. ``resume_from``: ``"auto"`` (the
        run's newest checkpoint, if any), the run folder or a checkpoint folder written with ``checkpoint=True``."""
        generators = rng_state()  # before the launch draws anything: N processes read the text as one does
        for name, value in (("sequence_length", sequence_length), ("mini_batch_size", mini_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not valid: pass a positive whole number.")
        lightning = take_lightning_arguments(kwargs)  # the rest are the optimizer's, as in flair
        launch = make_launch_config(**lightning.as_dict(), use_amp=use_amp)
        if not keeps_whole_model(launch.strategy):
            raise ValueError(
                f"strategy={lightning.strategy!r}: FabricLanguageModelTrainer trains with DDP ('ddp', 'ddp_spawn',"
                " 'ddp_fork', 'ddp_notebook' or 'auto'); a character language model fits on every device."
            )
        if launch.precision not in TRAINABLE_PRECISIONS:
            raise ValueError(
                f"precision={lightning.precision!r} ({launch.precision}) casts the whole model, which flair's"
                " LanguageModel cannot be (its _apply returns None, so .to(dtype) gives None): pass"
                " precision='32-true', 'bf16-mixed' or, on a GPU, '16-mixed'."
            )
        if is_url(base_path):
            raise ValueError(
                f"base_path={base_path!r}: FabricLanguageModelTrainer writes to a local folder (a URL is for"
                " FabricTrainer): pass a folder, and copy it to the store when the run ends."
            )
        base = Path(base_path)
        check_writable_folder(base)
        if resume_from is None and restarted_by_torchrun():
            resume_from = "auto"
        resume_folder, _ = checkpoint_to_resume(self.model, base, 0, resume_from)
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
            resume_folder=resume_folder,
            generators=generators,
        )
        self._check_corpus(arguments)
        every_parameter_learns(launch.strategy)  # no unused-parameter probe: every parameter of a LanguageModel learns
        run_job(LanguageModelJob(self, arguments), launch)

    def _check_corpus(self, arguments: LanguageModelArguments) -> None:
        """Refuse, before any process starts, a corpus that cannot fill every column of every process."""
        a, corpus = arguments, self.corpus
        world_size = a.launch.world_size
        if len(corpus.train) == 0:
            raise ValueError(f"the corpus has no training text: put one or more split files into {corpus.train.path}.")
        for what, text in (("validation split (valid.txt)", corpus.valid), ("test split (test.txt)", corpus.test)):
            check_enough_text(len(text), a.global_batch, what, a.mini_batch_size, world_size)
        for split_file in corpus.train.files:
            with open(split_file, encoding="utf-8") as split:  # characters, as flair reads them (not bytes)
                characters = len(split.read(2 * a.global_batch))  # no more than the two per column it needs
            check_enough_text(characters, a.global_batch, f"train split {split_file}", a.mini_batch_size, world_size)

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
