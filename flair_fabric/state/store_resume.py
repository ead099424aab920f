"""Which checkpoint of a run in object storage a run resumes from: only complete ones (with their marker) count,
and global rank 0's machine downloads it into its staging folder before any process starts."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from flair_fabric.state.run_state import RunState
from flair_fabric.state.run_store import CHECKPOINTS, RunStore
from flair_fabric.state.training_state import PROGRESS, check_resumable, checkpoint_to_resume
from flair_fabric.storage import is_url

log = logging.getLogger("flair")


def _named_checkpoint(store: RunStore, resume_from: str) -> str | None:
    """The name of the complete checkpoint ``resume_from`` names in ``store``: ``"auto"`` (the newest, if any), the
    run's URL or its checkpoints' (the newest), or a checkpoint's URL (or a file's in it)."""
    complete = store.complete_checkpoints()
    url = resume_from.rstrip("/")
    prefix = f"{store.url}/{CHECKPOINTS}"
    if resume_from == "auto" or url in (store.url, prefix):
        if not complete and resume_from != "auto":
            raise ValueError(f"resume_from={resume_from!r}: no complete checkpoint in {prefix}: pass 'auto' or None.")
        return complete[-1] if complete else None
    if not url.startswith(prefix + "/"):
        raise ValueError(
            f"resume_from={resume_from!r} is not a checkpoint of base_path={store.url!r}: with base_path in a"
            f" store, resume from 'auto' or from a '{prefix}/step-...' URL."
        )
    name = url[len(prefix) + 1 :].split("/")[0]
    if name not in complete:
        raise ValueError(
            f"resume_from={resume_from!r}: {prefix}/{name} has no completion marker (its upload did not finish, or it"
            " does not exist): nothing in it is read. Resume from 'auto' (the newest complete checkpoint)."
        )
    if name < complete[-1]:
        raise ValueError(
            f"resume_from={resume_from!r} is older than the newest checkpoint of base_path ({complete[-1]}): the"
            " resumed run's checkpoints would sort before the newer ones. Resume into another base_path."
        )
    return name


def checkpoint_in_store_to_resume(
    store: RunStore, model: torch.nn.Module, epoch: int, resume_from: str | Path | None, *, download: bool
) -> tuple[Path | None, int]:
    """Before any process starts: the checkpoint folder (in the staging folder) the run resumes from, and the epochs
    it starts after, as :func:`~flair_fabric.state.training_state.checkpoint_to_resume` for a local ``base_path``.
    ``download``: this process is global rank 0's (the one that reads it): it downloads the checkpoint and checks
    every file; the others read its progress record from the store."""
    if resume_from is None:
        return None, epoch
    if not is_url(resume_from) and resume_from != "auto":
        return checkpoint_to_resume(model, store.local, epoch, resume_from)
    name = _named_checkpoint(store, str(resume_from))
    if name is None:
        log.info(f"resume_from='auto': no complete checkpoint in {store.url}/{CHECKPOINTS}, starting afresh")
        return None, epoch
    if download:
        folder = store.download_checkpoint(name)
        progress = check_resumable(folder, model, epoch, resume_from)
    else:
        folder = store.local / CHECKPOINTS / name
        stored: Any = json.loads(store.fs.cat_file(f"{store.checkpoint_url(name)}/{PROGRESS}"))
        progress = check_resumable(folder, model, epoch, resume_from, RunState.from_stored(stored))
    log.info(f"resuming from {store.checkpoint_url(name)} (copied to {folder})")
    return folder, progress.epoch
