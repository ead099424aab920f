"""flair model files written once and atomically; weights handed from rank 0 to every rank."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import flair
from lightning.fabric import Fabric


def save_model_atomically(model: flair.nn.Model, path: str | Path, checkpoint: bool = False) -> None:
    """``model.save(path)`` through a temporary file in the same folder and a rename.

    A reader never sees a half-written file, and a crash during the save leaves the previous file intact.
    """
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        model.save(temporary, checkpoint=checkpoint)
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes 0600; a model file gets the usual permissions
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def save_on_global_zero(fabric: Fabric, model: flair.nn.Model, path: str | Path, checkpoint: bool) -> None:
    """Write the flair model file once, from global rank 0 (no collective: safe to call from any rank alone)."""
    if fabric.is_global_zero:
        save_model_atomically(model, path, checkpoint=checkpoint)


def load_from_global_zero(fabric: Fabric, model: flair.nn.Model, path: str | Path) -> bool:
    """Load the weights of the flair model file ``path`` into ``model`` on every rank.

    Only global rank 0 reads the file (other ranks may sit on machines that cannot see it); the weights travel
    over the process group. Returns whether the file existed. Every rank must call this.
    """
    path = Path(path)
    exists = fabric.broadcast(path.exists() if fabric.is_global_zero else None, src=0)
    if not exists:
        return False
    state = None
    if fabric.is_global_zero:
        state = {name: tensor.cpu() for name, tensor in model.load(path).state_dict().items()}
    state = fabric.broadcast(state, src=0)
    assert state is not None
    model.load_state_dict(state)
    return True
