"""``group_by_length``: an epoch's order rearranged so that each global batch holds data points of similar length.

Random batches pad every data point to the longest of its batch; a transformer computes those padded positions too.
Here the epoch's order (drawn as one process draws it) is cut into windows of ``window`` global batches; each window
is sorted by length (longest first; equal lengths keep their order in the epoch), cut into global batches, and the
window's batches are shuffled. The epoch's longest whole batch (the most padded positions) is then moved to the
front, so that a step that runs out of memory does so at once. A last window that is not full keeps its short batch
last, where the global batch cut expects it. The batches are shuffled with the torch generator of the process that
draws the epoch's order (global rank 0, or the one process), right after the order: the result depends on the seed,
the order, the lengths and the global batch, never on the number of processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flair_fabric.training.balancing import padded_cost


def grouped_by_length(
    order: Sequence[int], lengths: Sequence[int], global_batch_size: int, window: int, shuffle: bool
) -> list[int]:
    """``order`` rearranged window by window (see the module doc); ``shuffle=False`` keeps each window's batches
    longest first (nothing is drawn)."""
    span = window * global_batch_size
    batches: list[list[int]] = []
    for start in range(0, len(order), span):
        by_length = sorted(order[start : start + span], key=lambda index: -lengths[index])
        cut = [by_length[k : k + global_batch_size] for k in range(0, len(by_length), global_batch_size)]
        short = [cut.pop()] if len(cut[-1]) < global_batch_size else []
        if shuffle:
            cut = [cut[position] for position in torch.randperm(len(cut)).tolist()]
        batches += cut + short
    whole = [b for b, batch in enumerate(batches) if len(batch) == global_batch_size] or [0]  # (the short one stays)
    longest = max(whole, key=lambda b: padded_cost([lengths[index] for index in batches[b]]))
    batches.insert(0, batches.pop(longest))
    return [index for batch in batches for index in batch]


@dataclass(frozen=True)
class Grouping:
    """``group_by_length`` of a run: the train data points' lengths and the window in global batches."""

    lengths: Sequence[int]
    window: int

    def applied(self, order: Sequence[int], global_batch_size: int, shuffle: bool) -> list[int]:
        """``order`` grouped by length (:func:`grouped_by_length`)."""
        return grouped_by_length(order, self.lengths, global_batch_size, self.window, shuffle)
