"""Where a run stands: the one record the training loop reads and writes, and a checkpoint stores."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunProgress:
    """The loop's progress, saved as ``progress.json`` in a checkpoint and read back to resume."""

    epoch: int
    """Completed epochs."""
    batch_count: int
    """Optimizer steps taken (flair's ``batch_count``)."""
    best_epoch_score: float
    """The best dev score so far (or the lowest train loss, without a dev split)."""
    seed: int
    """The data-order seed every rank shares (0 in one process, where flair's own loader shuffles)."""
    world_size: int
    """The number of processes of the run that wrote it."""
    model_fingerprint: dict[str, str] = field(default_factory=dict)
    """The model's structure and dictionaries, to check that a resume continues the same model."""
    step_in_epoch: int = 0
    """Steps done in the epoch after ``epoch`` (0 at an epoch's end): where a mid-epoch resume continues."""
    epoch_position: int = 0
    """Data points of that epoch's order the ranks have read (to continue on another number of processes)."""
