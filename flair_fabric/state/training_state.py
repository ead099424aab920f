"""Resumable training state: checkpoints written atomically, kept k at a time, read back exactly, mid-epoch too.

``base_path/checkpoints/step-<steps>/`` holds one checkpoint, taken after ``<steps>`` optimizer steps:

- ``state.ckpt``: the model and the optimizer through ``fabric.save`` (one file from rank 0, or under ``"fsdp"`` a
  sharded distributed checkpoint written by every rank),
- ``extras.pt``: the plugins' schedulers, the gradient scaler, and every rank's own state: its random number
  generators (now and at the start of the epoch, which decided the epoch's data order in one process) and its part
  of the epoch's train loss,
- ``progress.json``: the run's :class:`~flair_fabric.state.run_state.RunState` (epochs, steps, the position in the
  epoch, best score, world size, model fingerprint, what the epoch's end owes), read before any
  process starts.

A checkpoint is written into ``.step-<steps>.tmp/`` and renamed into place when it is complete on every rank; only
then is it the newest, and only then are the oldest beyond ``keep_checkpoints`` removed. ``resume_from="auto"``
takes the newest complete one; a crash during a save leaves the previous ones as they were.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from lightning.fabric import Fabric

from flair_fabric.distributed.collectives import gather_to_global_zero
from flair_fabric.distributed.fingerprints import differences, model_fingerprint
from flair_fabric.distributed.stalls import wait_for_global_zero
from flair_fabric.state.run_state import RunState
from flair_fabric.state.safe_loading import UnsafeFile, check_distributed_checkpoint, checked_load

log = logging.getLogger("flair")

FOLDER = "checkpoints"
PROGRESS = "progress.json"


def checkpoints_folder(base_path: str | Path) -> Path:
    """Where a run in ``base_path`` keeps its checkpoints."""
    return Path(base_path) / FOLDER


def checkpoint_name(batch_count: int) -> str:
    """The folder name of the checkpoint taken after ``batch_count`` optimizer steps."""
    return f"step-{batch_count:09d}"


def complete_checkpoints(base_path: str | Path) -> list[Path]:
    """The complete checkpoints of the run in ``base_path``, oldest first."""
    folder = checkpoints_folder(base_path)
    if not folder.is_dir():
        return []
    found = [path for path in folder.glob("step-*") if path.is_dir() and (path / PROGRESS).is_file()]
    return sorted(found, key=lambda path: path.name)


def newest_checkpoint(base_path: str | Path) -> Path | None:
    """The newest complete checkpoint of the run in ``base_path``, if there is one."""
    found = complete_checkpoints(base_path)
    return found[-1] if found else None


def find_checkpoint(resume_from: str | Path | None, base_path: str | Path) -> Path | None:
    """The checkpoint ``resume_from`` names: ``None``, ``"auto"`` (the run's newest, if any) or a folder."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        return newest_checkpoint(base_path)
    folder = Path(resume_from)
    if folder.name in ("state.ckpt", "extras.pt", PROGRESS):  # a file inside the checkpoint folder
        folder = folder.parent
    if (folder / FOLDER).is_dir() and not (folder / PROGRESS).is_file():  # a run's folder: its checkpoints
        folder = folder / FOLDER
    if folder.name == FOLDER and not (folder / PROGRESS).is_file():  # the run's checkpoints folder: its newest
        newest = newest_checkpoint(folder.parent)
        folder = newest if newest is not None else folder
    if not (folder / PROGRESS).is_file():
        raise ValueError(
            f"resume_from={str(resume_from)!r} is not a flair-fabric checkpoint (no {PROGRESS} in it): pass a"
            f" '{FOLDER}/step-...' folder a run with checkpoints wrote, or resume_from='auto'."
        )
    return folder


def checkpoint_to_resume(
    model: torch.nn.Module, base_path: Path, epoch: int, resume_from: str | Path | None
) -> tuple[Path | None, int]:
    """Check the checkpoint ``model`` resumes from, before any process starts.

    Returns the checkpoint folder (``None`` for a fresh start) and the number of epochs the run starts after: the
    checkpoint's, or flair's own ``epoch`` argument."""
    folder = find_checkpoint(resume_from, base_path)
    if folder is None:
        if resume_from == "auto":
            log.info(f"resume_from='auto': no checkpoint in {checkpoints_folder(base_path)}, starting afresh")
        return None, epoch
    progress = check_resumable(folder, model, epoch, resume_from)
    newest = newest_checkpoint(base_path)
    if newest is not None and folder.resolve().parent == newest.resolve().parent and folder.name < newest.name:
        raise ValueError(
            f"resume_from={str(resume_from)!r} is older than the newest checkpoint of base_path ({newest}): the"
            " resumed run's checkpoints would sort before the newer ones, keep_checkpoints would remove them first"
            " and resume_from='auto' would go back to the newer ones. Resume into another base_path, or remove the"
            f" checkpoints after {folder.name} first."
        )
    return folder, progress.epoch


def check_resumable(
    folder: Path | str, model: torch.nn.Module, epoch: int, resume_from: Any, progress: RunState | None = None
) -> RunState:
    """Before any process starts: every file of the checkpoint in ``folder`` reads as plain data (unless its
    ``progress`` record is given: read elsewhere, its files are checked where they are read), it was written for
    ``model``, and flair's ``epoch`` does not contradict it. Returns its progress record."""
    try:
        progress = progress or check_checkpoint_folder(Path(folder))
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
    return progress


def resume_folder_of_global_zero(fabric: Fabric, folder: Path | None) -> Path | None:
    """The checkpoint global rank 0's caller chose to resume from, on every rank: on machines without a copy of it
    ``resume_from="auto"`` finds nothing, and every rank must resume alike. A collective."""
    return cast(Path | None, fabric.broadcast(folder, src=0)) if fabric.world_size > 1 else folder


def read_progress(folder: Path) -> RunState:
    """The run-state record of a checkpoint folder (JSON)."""
    try:
        return RunState.from_stored(json.loads((folder / PROGRESS).read_text(encoding="utf-8")))
    except (ValueError, TypeError, UnicodeDecodeError) as error:
        raise UnsafeFile(f"{folder / PROGRESS} is not a progress record flair-fabric wrote ({error})") from None


def check_checkpoint_folder(folder: Path) -> RunState:
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
        for index, generator in enumerate(state["cuda"][: torch.cuda.device_count()]):  # fewer GPUs visible now
            torch.cuda.set_rng_state(generator, index)


# --- plugin state ---------------------------------------------------------------------------------------------------


def plugin_schedulers(plugins: list[Any]) -> dict[str, Any]:
    """The learning-rate schedulers flair's functional plugins keep (``plugin.scheduler``), by a stable key: flair's
    plugin class (flair-fabric's versions for several processes share their flair class's key, so a checkpoint of
    one number of processes resumes on another) and a count."""
    schedulers: dict[str, Any] = {}
    for plugin in plugins:  # keyed by class and count: logger plugins exist on global rank 0 only
        scheduler = getattr(plugin, "scheduler", None)
        if scheduler is not None and hasattr(scheduler, "state_dict"):
            flairs = next((cls for cls in type(plugin).__mro__ if cls.__module__.startswith("flair.")), type(plugin))
            name = flairs.__name__
            count = sum(key.startswith(f"{name}#") for key in schedulers)
            schedulers[f"{name}#{count}"] = scheduler
    return schedulers


# --- save and load --------------------------------------------------------------------------------------------------


def save_training_state(
    fabric: Fabric,
    base_path: Path,
    module: Any,
    optimizer: Any,
    schedulers: dict[str, Any],
    progress: RunState,
    rank_state: dict[str, Any],
    keep: int,
    extras: dict[str, Any] | None = None,
    model_keys: set[str] | None = None,
) -> Path:
    """Write a complete checkpoint of the run in ``base_path`` and keep the newest ``keep``: ``schedulers`` by a
    stable key, ``rank_state`` this rank's own part, ``extras`` more plain values of the job (global rank 0's),
    ``model_keys`` the model's state keys to keep (``None``: all; adapters: the trainable ones, docs/peft.md).
    Returns its folder. A collective: every rank must call it."""
    every_rank = gather_to_global_zero(fabric, {**rank_state, "rng": rng_state()})  # for rank 0 to write
    folder = checkpoints_folder(base_path) / checkpoint_name(progress.batch_count)
    temporary = folder.parent / f".{folder.name}.tmp"
    if fabric.is_global_zero:
        for unfinished in folder.parent.glob(".step-*.tmp"):  # writes a crash interrupted
            shutil.rmtree(unfinished, ignore_errors=True)
        temporary.mkdir(parents=True, mode=0o700)  # private to the user while it is written
    fabric.barrier()
    kept = None if model_keys is None else {"model": lambda key, _: key in model_keys}
    fabric.save(temporary / "state.ckpt", {"model": module, "optimizer": optimizer}, filter=kept)
    if fabric.is_global_zero:
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        stored = {
            "schedulers": {key: scheduler.state_dict() for key, scheduler in schedulers.items()},
            "scaler": scaler.state_dict() if scaler is not None else None,
            "ranks": every_rank,
            "job": extras or {},
        }
        torch.save(stored, temporary / "extras.pt")
        (temporary / PROGRESS).write_text(json.dumps(progress.stored(), indent=2), encoding="utf-8")
        _make_private(temporary)
        shutil.rmtree(folder, ignore_errors=True)  # the same step saved before (an epoch end on a step trigger)
        os.replace(temporary, folder)  # from here on it is the newest complete checkpoint
        for old in complete_checkpoints(base_path)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    wait_for_global_zero(fabric)
    return folder


def _make_private(folder: Path) -> None:
    """Owner-only permissions for a checkpoint folder and what is in it (0o700 folders, 0o600 files)."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)


def load_training_state(
    fabric: Fabric, folder: Path, schedulers: dict[str, Any]
) -> tuple[RunState, list[dict[str, Any]], dict[str, Any]]:
    """Load ``schedulers`` (by their keys) and the gradient scaler from ``folder`` (the model and the optimizer are the
    strategy's to load, from ``folder / "state.ckpt"``); return the run-state record, every rank's own state as the
    run that wrote it kept it (its generators, its part of the epoch's loss), and the job's extras. Global rank 0
    reads the files; the other ranks receive them. A collective."""
    stored = (read_progress(folder).stored(), checked_load(folder / "extras.pt")) if fabric.is_global_zero else None
    if fabric.world_size > 1:  # read by global rank 0 only: the other machines need no copy of the files
        stored = fabric.broadcast(stored, src=0)
    assert stored is not None
    progress, extras = RunState.from_stored(stored[0]), stored[1]
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
    return progress, list(extras["ranks"]), dict(extras.get("job", {}))


def keep_loss_rows_up_to(loss_file: Path, epoch: int, step: int) -> None:
    """Drop the rows of ``loss.tsv`` written after the checkpoint a run resumes from: after ``epoch`` (flair's rows,
    one per epoch), or after optimizer step ``step`` (rows of evaluations inside epochs, with a ``STEP`` column)."""
    if not loss_file.is_file():
        return
    lines = loss_file.read_text(encoding="utf-8").splitlines(keepends=True)
    header = lines[0].rstrip("\n").split("\t") if lines else []
    column, last = (header.index("STEP"), step) if "STEP" in header else (0, epoch)
    rows = [line for line in lines[1:] if int(line.split("\t")[column]) <= last]
    if not rows:  # the header is written again with the first row
        loss_file.unlink()
    elif len(rows) + 1 != len(lines):
        loss_file.write_text("".join(lines[:1] + rows), encoding="utf-8")
