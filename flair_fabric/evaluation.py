"""Evaluation during and after distributed training.

The model is scored once, on global rank 0, with flair's own ``evaluate``; the :class:`~flair.training_utils.Result`
is broadcast, so every rank takes the same best-model and annealing decisions. Only rank 0 writes the output file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flair
from flair.training_utils import EmbeddingStorageMode, Result, store_embeddings
from lightning.fabric import Fabric
from torch.utils.data import Dataset


def evaluate_on_global_zero(
    fabric: Fabric,
    model: flair.nn.Model,
    data: Dataset,
    *,
    out_path: Path | None,
    embeddings_storage_mode: EmbeddingStorageMode | None = None,
    **evaluate_kwargs: Any,
) -> Result:
    """``model.evaluate(data, ...)`` on global rank 0; every rank returns rank 0's result.

    ``embeddings_storage_mode``, if given, is applied to ``data`` after scoring, as flair's trainer does.
    """
    result: Result | None = None
    if fabric.is_global_zero:
        result = model.evaluate(data, out_path=out_path, **evaluate_kwargs)
        if embeddings_storage_mode is not None:
            store_embeddings(data, embeddings_storage_mode)
    result = fabric.broadcast(result, src=0)
    assert result is not None
    return result
