"""Column sharding of batchified text: ``N`` ranks with ``mini_batch_size=b`` train exactly as one process with
``N·b`` columns.

flair's ``LanguageModelTrainer`` cuts a split's character ids into ``mini_batch_size`` equal columns (``_batchify``)
and walks down all of them together, carrying one hidden state per column. Here the split is batchified into
``N·b`` columns as one process would, and rank ``r`` keeps columns ``r·b .. (r+1)·b - 1``: the same columns, the same
truncated back-propagation, and the mean loss over all columns is the mean of the ranks' means (every column has the
same length), which is what DDP's gradient averaging computes.
"""

from __future__ import annotations

import torch
from flair.trainers.language_model_trainer import LanguageModelTrainer


def rank_columns(data: torch.Tensor, per_rank: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's ``per_rank`` columns of ``data`` batchified into ``per_rank * world_size`` columns (rows: time)."""
    columns = LanguageModelTrainer._batchify(data, per_rank * world_size)
    return columns[:, rank * per_rank : (rank + 1) * per_rank].contiguous()


def check_enough_text(characters: int, global_batch: int, what: str, mini_batch_size: int, world_size: int) -> None:
    """At least two rows after batchifying (flair's own condition for the validation split); otherwise a clear error
    naming the arguments."""
    if characters // global_batch < 2:
        raise ValueError(
            f"the {what} has {characters} characters: with mini_batch_size={mini_batch_size} on {world_size}"
            f" process(es) it needs at least {2 * global_batch} (two per column); use a smaller mini_batch_size, fewer"
            " devices or more text."
        )
