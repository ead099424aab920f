"""Resumable training state: one checkpoint folder per run, replaced atomically, read back exactly.

``base_path/checkpoint/`` holds

- ``state.ckpt``: the model and the optimizer through ``fabric.save`` (one file from rank 0, or under ``"fsdp"`` a
  sharded distributed checkpoint written by every rank),
- ``extras.pt``: the state of the plugins' schedulers, the gradient scaler, and the random number generators of
  every rank,
- ``progress.json``: completed epochs, optimizer steps, best score so far, the data-order seed, the world size and
  the model's fingerprint (read before any process starts, to check a resume).

A new checkpoint is written into ``.checkpoint.tmp/`` and then takes the place of the old one by renames; until
the new one is complete the old one stays where it was, so a crash during a save never leaves a broken checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import flair
import numpy as np
import torch
from lightning.fabric import Fabric

from flair_fabric.distributed.collectives import gather_to_global_zero
from flair_fabric.distributed.fingerprints import differences, model_fingerprint
from flair_fabric.distributed.stalls import wait_for_global_zero
from flair_fabric.state.progress import RunProgress
from flair_fabric.state.safe_loading import UnsafeFile, check_distributed_checkpoint, checked_load

log = logging.getLogger("flair")

FOLDER = "checkpoint"
PROGRESS = "progress.json"


def checkpoint_folder(base_path: str | Path) -> Path:
    """Where a run in ``base_path`` keeps its checkpoint."""
    return Path(base_path) / FOLDER


def _previous(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.old"


def _temporary(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.tmp"


def find_checkpoint(resume_from: str | Path | None, base_path: str | Path) -> Path | None:
    """The checkpoint folder ``resume_from`` names: ``None``, ``"auto"`` (the run's own, if there is one) or a path."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        folder = checkpoint_folder(base_path)
        for candidate in (folder, _previous(folder)):  # the old one is complete while a new one replaces it
            if (candidate / PROGRESS).is_file():
                return candidate
        return None
    folder = Path(resume_from)
    if folder.name in ("state.ckpt", "extras.pt", PROGRESS):  # a file inside the checkpoint folder
        folder = folder.parent
    if not (folder / PROGRESS).is_file():
        raise ValueError(
            f"resume_from={str(resume_from)!r} is not a flair-fabric checkpoint (no {PROGRESS} in it): pass the"
            f" '{FOLDER}' folder a run with checkpoint_every_n_epochs wrote, or resume_from='auto'."
        )
    return folder


def checkpoint_to_resume(
    model: flair.nn.Model,
    base_path: Path,
    epoch: int,
    checkpoint_every_n_epochs: int,
    resume_from: str | Path | None,
) -> tuple[Path | None, int]:
    """Check the checkpoint arguments and the checkpoint ``model`` resumes from, before any process starts.

    Returns the checkpoint folder (``None`` for a fresh start) and the number of epochs the run starts after: the
    checkpoint's, or flair's own ``epoch`` argument."""
    if isinstance(checkpoint_every_n_epochs, bool) or not isinstance(checkpoint_every_n_epochs, int):
        raise ValueError(
            f"checkpoint_every_n_epochs={checkpoint_every_n_epochs!r} is not valid: pass a number of epochs"
            " (0 for no checkpoints)."
        )
    if checkpoint_every_n_epochs < 0:
        raise ValueError(f"checkpoint_every_n_epochs={checkpoint_every_n_epochs} is not valid: pass 0 or more.")
    folder = find_checkpoint(resume_from, base_path)
    if folder is None:
        if resume_from == "auto":
            log.info(f"resume_from='auto': no checkpoint in {checkpoint_folder(base_path)}, starting afresh")
        return None, epoch
    try:
        progress = check_checkpoint_folder(folder)
    except UnsafeFile as error:
        raise ValueError(
            f"resume_from={str(resume_from)!r}: {error}. It was not written by flair-fabric or was changed since;"
            " nothing in it was run. Resume only from checkpoints you trust."
        ) from None
    differing = differences(progress.model_fingerprint, model_fingerprint(model))
    if differing:
        raise ValueError(
            f"resume_from={str(resume_from)!r}: the checkpoint in {folder} was written for another model"
            f" (differs in: {', '.join(differing)}): resume with the model the checkpoint was trained from."
        )
    if epoch not in (0, progress.epoch):
        raise ValueError(
            f"epoch={epoch} and resume_from={str(resume_from)!r} (which ends at epoch {progress.epoch}) were"
            " both given: leave epoch out when resuming."
        )
    return folder, progress.epoch


def read_progress(folder: Path) -> RunProgress:
    """The progress record of a checkpoint folder (JSON)."""
    try:
        return RunProgress(**json.loads((folder / PROGRESS).read_text(encoding="utf-8")))
    except (ValueError, TypeError, UnicodeDecodeError) as error:
        raise UnsafeFile(f"{folder / PROGRESS} is not a progress record flair-fabric wrote ({error})") from None


def check_checkpoint_folder(folder: Path) -> RunProgress:
    """Read every file of a checkpoint as plain data, before anything uses it; return its progress record.

    A file that holds code or unexpected objects raises :class:`~flair_fabric.safe_loading.UnsafeFile`, and
    nothing in it runs."""
    progress = read_progress(folder)
    checked_load(folder / "extras.pt")
    state = folder / "state.ckpt"
    if state.is_dir():
        check_distributed_checkpoint(state)
    else:
        checked_load(state)
    return progress


# --- random number generators -------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's random number generators."""
    name, keys, position, has_gauss, cached_gaussian = cast(tuple[str, Any, int, int, float], np.random.get_state())
    state: dict[str, Any] = {
        "python": random.getstate(),
        # as tensors and numbers, so that the checkpoint loads as plain data (weights_only=True)
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put this process's random number generators back where ``state`` says."""
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- plugin state ---------------------------------------------------------------------------------------------------


def _schedulers(plugins: list[Any]) -> dict[str, Any]:
    """The learning-rate schedulers flair's functional plugins keep (``plugin.scheduler``), by a stable key."""
    schedulers: dict[str, Any] = {}
    for plugin in plugins:  # keyed by class and count: logger plugins exist on global rank 0 only
        scheduler = getattr(plugin, "scheduler", None)
        if scheduler is not None and hasattr(scheduler, "state_dict"):
            name = type(plugin).__name__
            count = sum(key.startswith(f"{name}#") for key in schedulers)
            schedulers[f"{name}#{count}"] = scheduler
    return schedulers


# --- save and load --------------------------------------------------------------------------------------------------


def save_training_state(
    fabric: Fabric, folder: Path, module: Any, optimizer: Any, plugins: list[Any], progress: RunProgress
) -> None:
    """Write the complete training state to ``folder``, replacing what was there only once it is complete.

    A collective: every rank must call it.
    """
    rng = gather_to_global_zero(fabric, rng_state())  # every rank's generators, for rank 0 to write
    temporary = _temporary(folder)
    if fabric.is_global_zero:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True, mode=0o700)  # private to the user while it is written
    fabric.barrier()
    fabric.save(temporary / "state.ckpt", {"model": module, "optimizer": optimizer})
    if fabric.is_global_zero:
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        extras = {
            "schedulers": {key: scheduler.state_dict() for key, scheduler in _schedulers(plugins).items()},
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng,
        }
        torch.save(extras, temporary / "extras.pt")
        (temporary / PROGRESS).write_text(json.dumps(asdict(progress), indent=2), encoding="utf-8")
        _make_private(temporary)
        _replace_folder(temporary, folder)
    wait_for_global_zero(fabric)


def _make_private(folder: Path) -> None:
    """Owner-only permissions for a checkpoint folder and what is in it (0o700 folders, 0o600 files)."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)


def _replace_folder(new: Path, folder: Path) -> None:
    previous = _previous(folder)
    if folder.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(folder, previous)
    os.replace(new, folder)
    shutil.rmtree(previous, ignore_errors=True)


def load_training_state(
    fabric: Fabric, folder: Path, module: Any, optimizer: Any, plugins: list[Any]
) -> tuple[RunProgress, dict[str, Any] | None]:
    """Load model, optimizer, schedulers and scaler from ``folder``; return the progress and this rank's random
    number generator state (``None`` if the checkpoint was written with another number of processes).

    A collective: every rank must call it.
    """
    progress = read_progress(folder)
    fabric.load(folder / "state.ckpt", {"model": module, "optimizer": optimizer}, weights_only=True)
    extras = checked_load(folder / "extras.pt")
    schedulers = _schedulers(plugins)
    if schedulers.keys() != extras["schedulers"].keys():
        raise ValueError(
            f"the checkpoint in {folder} was written with the schedulers {sorted(extras['schedulers'])}, this run has"
            f" {sorted(schedulers)}: resume with the same training arguments and plugins."
        )
    for key, scheduler in schedulers.items():
        scheduler.load_state_dict(extras["schedulers"][key])
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    if scaler is not None and extras["scaler"] is not None:
        scaler.load_state_dict(extras["scaler"])
    if progress.world_size != fabric.world_size:
        log.warning(
            f"resuming a checkpoint of {progress.world_size} process(es) on {fabric.world_size}: model, optimizer and"
            " schedules continue exactly, but the random number streams and each process's data differ from the"
            " run that wrote it."
        )
        return progress, None
    return progress, extras["rng"][fabric.global_rank]


def keep_loss_rows_up_to(loss_file: Path, epoch: int) -> None:
    """Drop the rows of flair's ``loss.tsv`` after ``epoch`` (written after the checkpoint a run resumes from)."""
    if not loss_file.is_file():
        return
    lines = loss_file.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for number, line in enumerate(lines) if number == 0 or int(line.split("\t", 1)[0]) <= epoch]
    if kept != lines:
        loss_file.write_text("".join(kept), encoding="utf-8")
