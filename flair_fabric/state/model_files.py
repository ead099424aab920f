"""flair model files written once and atomically; weights handed from rank 0 to every rank.

A sharded model (``strategy="fsdp"``) is consolidated first by its strategy: its whole weights are gathered to global
rank 0, which writes an ordinary flair model file (``TextClassifier.load(path)`` reads it in one process); loading
scatters rank 0's weights back into the shards.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import flair
import torch
from lightning.fabric import Fabric

from flair_fabric.distributed.stalls import wait_for_global_zero
from flair_fabric.state.adapter_files import write_adapter_folders
from flair_fabric.state.adapters import has_adapters
from flair_fabric.state.model_state import model_file_state, save_flair_state


class ModelFileOptions(Protocol):
    """What a run's options say about its model files (:class:`~flair_fabric.training.arguments.TrainArguments`)."""

    @property
    def save_adapters(self) -> bool:
        """Beside each model file, also its unmerged adapters (:mod:`flair_fabric.state.adapter_files`)."""


def write_atomically(path: str | Path, write: Callable[[str], None]) -> None:
    """``write(temporary)`` into a temporary file in ``path``'s folder, then a rename to ``path``.

    A reader never sees a half-written file, and a crash during the write leaves the previous file intact."""
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(descriptor)
    try:
        write(temporary)
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes 0600; a model file gets the usual permissions
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def save_model_atomically(
    model: flair.nn.Model,
    path: str | Path,
    checkpoint: bool = False,
    weights: dict[str, torch.Tensor] | None = None,
) -> None:
    """``model.save(path)`` through :func:`write_atomically`. ``weights``, if given, are written as the model's state
    dict (the consolidated weights of a sharded model)."""

    def write(temporary: str) -> None:
        if weights is None and not has_adapters(model):
            model.save(temporary, checkpoint=checkpoint)
        else:
            save_flair_state(model_file_state(model, weights), temporary)

    write_atomically(path, write)


def check_writable_folder(base_path: str | Path) -> None:
    """``base_path`` exists (it is created if needed) and a file can be written into it; otherwise a clear error."""
    folder = Path(base_path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(
            f"base_path={str(base_path)!r} cannot be written ({error.strerror or error}): pass a folder you can"
            " create and write files in."
        ) from None


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def save_on_global_zero(
    fabric: Fabric,
    model: flair.nn.Model,
    path: str | Path,
    checkpoint: bool,
    weights: dict[str, torch.Tensor] | None = None,
    options: ModelFileOptions | None = None,
) -> None:
    """Write the flair model file once, from global rank 0; ``weights``: the whole weights of a sharded model,
    gathered to rank 0 before (the strategy's ``whole_weights``); ``options``: the run's (with ``save_adapters``,
    the unmerged adapters' folder beside the file too). Every rank calls it; the others wait."""
    if fabric.is_global_zero and options is not None and options.save_adapters:
        write_adapter_folders(model, path, weights)
    if fabric.is_global_zero:
        save_model_atomically(model, path, checkpoint=checkpoint, weights=weights)
    wait_for_global_zero(fabric)  # a slow disk must not trip the short timeout of the next training collective


def load_from_global_zero(
    fabric: Fabric, model: flair.nn.Model, path: str | Path, load: Callable[[dict[str, torch.Tensor] | None], None]
) -> bool:
    """Read the weights of the flair model file ``path`` on global rank 0 only (other ranks may sit on machines that
    cannot see it) and hand them to ``load`` on every rank (rank 0's state, ``None`` elsewhere: the strategy's
    ``load_whole_weights`` moves them over the process group). Returns whether the file existed. Every rank must
    call this."""
    path = Path(path)
    exists = fabric.broadcast(path.exists() if fabric.is_global_zero else None, src=0)
    if not exists:
        return False
    state = None
    if fabric.is_global_zero:
        state = {name: tensor.cpu() for name, tensor in model.load(path).state_dict().items()}
    wait_for_global_zero(fabric)
    load(state)
    return True
