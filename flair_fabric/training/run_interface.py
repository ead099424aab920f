"""What the parts of one rank's training run (the step, the evaluation, the checkpoints) use of the run, so that they
need no import of :mod:`flair_fabric.training.run`, not even for typing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from lightning.fabric import Fabric

from flair_fabric.distributed.lockstep import Agreed, Lockstep
from flair_fabric.distributed.stalls import Position
from flair_fabric.state.run_state import RunState
from flair_fabric.state.uploads import Uploads
from flair_fabric.strategies.base import TrainingStrategy
from flair_fabric.training.arguments import FlairArguments, TrainArguments
from flair_fabric.training.grouping import Grouping
from flair_fabric.training.interface import FlairTrainer
from flair_fabric.training.loss import GlobalLoss, LossTracker
from flair_fabric.training.out_of_memory import ChunksOnOutOfMemory
from flair_fabric.training.participation import Participation
from flair_fabric.training.setup import TrainingData


class Run(Protocol):
    """What the parts of one rank's run (the step, the evaluation, the checkpoints) use of
    :class:`~flair_fabric.training.run.TrainingRun`."""

    fabric: Fabric
    arguments: TrainArguments
    flair_arguments: FlairArguments
    trainer: FlairTrainer
    module: Any
    strategy: TrainingStrategy
    progress: RunState
    position: Position
    lockstep: Lockstep
    data: TrainingData
    base_path: Path
    uploads: Uploads | None
    participation: Participation | None
    chunks_on_out_of_memory: ChunksOnOutOfMemory | None
    dynamic_embeddings: list[str] | None
    grouping: Grouping | None
    length_of: Callable[[list], list[int]]

    def global_loss(self, loss: LossTracker, *also: float) -> tuple[GlobalLoss, Agreed]:
        """The loss all-reduced over the ranks; where the ranks also agree on stops and checkpoints."""
        ...

    def agree_on_stopping(self) -> None:
        """Every rank stops here if a plugin on any rank stopped since the last agreement."""

    def save_model(self, model_file: str | Path, checkpoint: bool = False) -> None:
        """Write the model once, from global rank 0 (every rank calls it)."""

    def load_model(self, model_file: str | Path) -> bool:
        """Load a model file into the model on every rank; whether it existed."""

    def shuffles(self, epoch: int) -> bool:
        """Whether ``epoch``'s order is shuffled."""
