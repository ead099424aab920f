"""What the layers above ask of a split without building its data points (the one small Protocol of docs/data.md).

A split that stores its data points (a :class:`~flair_fabric.data.split.MappedSplit`) answers its lengths from a
column, and builds each data point anew when it is read: nothing a run writes onto a data point (stored embeddings,
predicted labels) stays on the split. flair's ``Subset`` and ``ConcatDataset`` of such splits (flair's sampled
splits, ``train_with_dev``) answer alike; any other dataset answers ``None``/``False``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from torch.utils.data import ConcatDataset, Dataset, Subset


@runtime_checkable
class StoredSplit(Protocol):
    """A split that builds its data points on demand and stores their lengths."""

    def lengths(self) -> Sequence[int] | np.ndarray:
        """Each data point's length as flair-fabric's balancing counts it, without building one."""
        ...


def stored_lengths(data: Dataset | None) -> list[int] | None:
    """The stored length of every data point of ``data``, or ``None`` where some part of it stores none."""
    if isinstance(data, StoredSplit):
        return [int(length) for length in data.lengths()]
    if isinstance(data, Subset):
        inner = stored_lengths(data.dataset)
        return None if inner is None else [inner[int(index)] for index in data.indices]
    if isinstance(data, ConcatDataset):
        parts = [stored_lengths(part) for part in data.datasets]
        return None if any(part is None for part in parts) else [length for part in parts for length in part or []]
    return None


def builds_anew(data: Dataset | None) -> bool:
    """Whether every data point of ``data`` is built anew on each read (so nothing written onto one stays): read from
    the structure of ``data``, without reading a length."""
    if isinstance(data, StoredSplit):
        return True
    if isinstance(data, Subset):
        return builds_anew(data.dataset)
    if isinstance(data, ConcatDataset):
        return all(builds_anew(part) for part in data.datasets)
    return False
