"""Where a run lives and which checkpoint it continues from, decided before any process starts: a URL ``base_path``
is a run in a store (checked first: reachable, writable); after a torchrun restart, or when Ray restarted the
workers, the run continues from the newest complete checkpoint; in a store only checkpoints with their marker
count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flair_fabric.launch.environment import is_or_starts_global_zero, restarted_by_torchrun
from flair_fabric.launch.ray_train import resume_under_ray
from flair_fabric.state.run_store import RunStore
from flair_fabric.state.store_resume import checkpoint_in_store_to_resume
from flair_fabric.state.training_state import checkpoint_to_resume
from flair_fabric.storage import is_url


def run_store(base_path: Any) -> RunStore | None:
    """``base_path`` as a URL: the run's store, checked before anything starts; a local path: ``None``."""
    if not is_url(base_path):
        return None
    store = RunStore.of(str(base_path))
    store.check_writable()
    return store


def checkpoint_to_continue(
    model: torch.nn.Module, store: RunStore | None, base_path: Path, epoch: int, resume_from: Any
) -> tuple[Path | None, int]:
    """The checkpoint folder the run resumes from (``None``: a fresh start) and the epochs it starts after."""
    if resume_from is None and restarted_by_torchrun():
        resume_from = "auto"  # an elastic restart continues from the last checkpoint
    resume_from = resume_under_ray(resume_from, base_path)  # the newest: Ray's or base_path's
    if store is not None:  # only complete checkpoints in the store count; global rank 0's machine downloads it
        return checkpoint_in_store_to_resume(store, model, epoch, resume_from, download=is_or_starts_global_zero())
    return checkpoint_to_resume(model, base_path, epoch, resume_from)
