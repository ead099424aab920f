"""What a training run uses of its trainer, so that no module of the run imports the facade, not even for typing:
flair's ``ModelTrainer`` members, read and written as flair's own ``train_custom`` does (events, plugins, the model
card, metric records, the current learning rate). :class:`~flair_fabric.FabricTrainer` satisfies it, as any
``ModelTrainer`` does."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

import flair
import torch
from flair.data import Corpus
from flair.trainers.plugins import MetricRecord, TrainerPlugin
from flair.training_utils import Result
from torch.utils.data import Dataset


class FlairTrainer(Protocol):
    """The members of flair's ``ModelTrainer`` a run reads and writes (flair's plugins see the same ones)."""

    model: flair.nn.Model
    corpus: Corpus
    optimizer: torch.optim.Optimizer | None
    return_values: dict[str, Any]
    context_stack: contextlib.ExitStack

    @property
    def plugins(self) -> list[TrainerPlugin]:
        """The plugins attached to the trainer (flair's)."""

    def dispatch(self, event: str, *args: Any, **kwargs: Any) -> None:
        """flair's event dispatch to the attached plugins."""

    def reset_training_attributes(self) -> None:
        """flair's clean-up after training."""

    def check_for_and_delete_previous_best_models(self, base_path: Path) -> None:
        """flair's removal of an old best-model.pt."""

    def _initialize_model_card(self, **training_parameters: Any) -> dict[str, Any]: ...

    def _get_train_data(self, train_with_dev: bool, train_with_test: bool) -> Dataset: ...

    def _sample_train_split(self, monitor_train_sample: float | int) -> Any: ...

    def _get_current_lr_and_momentum(self, batch_count: int) -> tuple[str, str]: ...

    def _record(self, metric: MetricRecord) -> None: ...

    def _publish_eval_result(self, result: Result, prefix: Any, **kw: Any) -> None: ...

    def _backward(self, loss: torch.Tensor) -> None: ...
