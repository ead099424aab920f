"""A language-model run's resumable state: written by global rank 0 after every split (``checkpoint=True``), read by
rank 0 and broadcast on resume, so that a killed run continues exactly where its last split ended."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

from flair_fabric.state.model_files import write_atomically
from flair_fabric.state.safe_loading import checked_load

STATE_FILE = "lm-checkpoint.pt"


def state_file(base_path: Path) -> Path:
    """Where a run in ``base_path`` keeps its resumable state."""
    return base_path / STATE_FILE


def resume_file(resume_from: str | Path | None, base_path: Path) -> Path | None:
    """The state file ``resume_from`` names: ``"auto"`` takes the run's own if there is one; a path must exist."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        own = state_file(base_path)
        return own if own.is_file() else None
    path = Path(resume_from)
    path = state_file(path) if path.is_dir() else path
    if not path.is_file():
        raise ValueError(
            f"resume_from={str(resume_from)!r}: no {STATE_FILE} there; pass 'auto', the run's folder or the file."
        )
    return path


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` through a temporary file and a rename: a crash leaves the previous state intact."""
    write_atomically(path, lambda temporary: torch.save(state, temporary))


def load_state_on_every_rank(fabric: Fabric, path: Path) -> dict[str, Any]:
    """Global rank 0 reads ``path`` (plain data only); every rank gets its content (no shared disk needed)."""
    state: dict[str, Any] = checked_load(path) if fabric.is_global_zero else {}
    return fabric.broadcast(state, src=0)
