"""Where a run lives and which checkpoint it continues from, decided before any process starts: a URL ``base_path``
is a run in a store (checked first: reachable, writable); after a torchrun restart, or when Ray restarted the
workers, the run continues from the newest complete checkpoint; in a store only checkpoints with their marker
count."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric import Fabric

from flair_fabric.launch.environment import is_or_starts_global_zero, restarted_by_torchrun
from flair_fabric.launch.ray_train import resume_under_ray
from flair_fabric.state.run_store import CHECKPOINTS, RunStore
from flair_fabric.state.store_resume import checkpoint_in_store_to_resume
from flair_fabric.state.training_state import checkpoint_to_resume, resume_folder_of_global_zero
from flair_fabric.storage import is_url

if TYPE_CHECKING:
    from flair_fabric.strategies.base import TrainingStrategy
    from flair_fabric.training.arguments import TrainArguments


def run_store(base_path: Any, storage_options: dict[str, Any] | None = None) -> RunStore | None:
    """``base_path`` as a URL: the run's store (reached with ``storage_options``), checked before anything starts; a
    local path: ``None``."""
    if not is_url(base_path):
        if storage_options:
            raise ValueError(
                f"storage_options are for a base_path in a store (a URL such as 's3://bucket/run'), and"
                f" base_path={str(base_path)!r} is a local folder: leave storage_options out."
            )
        return None
    store = RunStore.of(str(base_path), storage_options)
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


def checkpoint_to_read_here(fabric: Fabric, arguments: TrainArguments, strategy: TrainingStrategy) -> Path | None:
    """On every rank, where it reads the checkpoint global rank 0's caller chose to resume from (``None``: none). In a
    run in a store whose strategy reads it on every rank (FSDP, DeepSpeed), each machine's copy in its own staging
    folder, downloaded by the machine's local rank 0 where it is missing; elsewhere global rank 0's folder (global
    rank 0 reads it and sends it to the others). A collective."""
    folder, store = resume_folder_of_global_zero(fabric, arguments.resume_folder), arguments.store
    if folder is None or store is None or not strategy.reads_checkpoints_on_every_rank:
        return folder
    if folder.parent.name != CHECKPOINTS or folder.parent.parent.name != store.local.name:
        return folder  # a local checkpoint folder named in resume_from, not one of the store's
    if fabric.local_rank == 0:
        store.download_checkpoint(folder.name)  # global rank 0's machine has it already: the same marker
    fabric.barrier()
    return store.local / CHECKPOINTS / folder.name
