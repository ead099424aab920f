"""The arguments of one distributed language-model run, checked and frozen before any process starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flair_fabric.launch.config import LaunchConfig


@dataclass(frozen=True)
class LanguageModelArguments:
    """flair's ``LanguageModelTrainer.train`` arguments (``mini_batch_size`` per process) and the launch."""

    base_path: Path
    sequence_length: int
    learning_rate: float
    mini_batch_size: int
    anneal_factor: float
    patience: int
    clip: float
    max_epochs: int
    checkpoint: bool
    grow_to_sequence_length: int
    num_workers: int
    launch: LaunchConfig
    optimizer_options: dict[str, Any] = field(default_factory=dict)
    resume_folder: Path | None = None
    """The checkpoint the run continues from (checked before any process started)."""
    generators: dict[str, Any] = field(default_factory=dict)
    """The caller's random generators when it called ``train``: every rank starts from global rank 0's."""

    @property
    def global_batch(self) -> int:
        """Columns of the whole run: ``mini_batch_size`` on every process."""
        return self.mini_batch_size * self.launch.world_size
