"""A cache folder's housekeeping: its entries with their sizes and last use, the temporary folders that killed
builds left, removing what no run used for a while, and verifying every entry in full
(``python -m flair_fabric cache list|prune|verify``, :mod:`~flair_fabric.data.command`)."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flair_fabric.data.cache import USED, discard, read_meta
from flair_fabric.data.errors import CacheFolderError
from flair_fabric.data.integrity import verify

CONVERTING = ".converting-"
OWNER = ".owner"
OWNERLESS_GRACE_S = 60.0
"""A conversion folder without its owner file (its process was killed between making the two) counts as dead after
this many seconds."""

COMPLETE = "complete"
INCOMPLETE = "incomplete or of another format version"
BUILDING = "being built"
DEAD = "left by a killed build"


@dataclass(frozen=True)
class Entry:
    """One folder of a cache: an entry (named by its key) or a temporary folder, its size in bytes, its last use
    (seconds since the epoch: the last open of an entry; the last change of a temporary folder) and its state."""

    path: Path
    size: int
    last_used: float
    state: str


@contextlib.contextmanager
def conversion_folder(root: Path) -> Iterator[Path]:
    """A temporary folder for a corpus being converted (``map_corpus``), removed afterwards; while its process
    lives it holds a lock on the folder's owner file, so that a folder left by a killed process is known as dead."""
    try:
        temporary = Path(tempfile.mkdtemp(prefix=CONVERTING, dir=root))
    except OSError as error:
        raise CacheFolderError(root, error.strerror or str(error)) from None
    try:
        with open(temporary / OWNER, "w") as owner:
            fcntl.flock(owner, fcntl.LOCK_EX)
            yield temporary
    finally:
        discard(temporary)


@contextlib.contextmanager
def _held_unless_busy(lock_file: Path, create: bool) -> Iterator[bool]:
    """Take the lock of ``lock_file`` without waiting: ``True`` while this holds it, ``False`` where another process
    holds it (or, without ``create``, where the file is missing)."""
    try:
        handle = open(lock_file, "a" if create else "r")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        yield False
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_dead_conversions(root: Path) -> None:
    """The conversion folders of ``root`` whose process was killed (a ``map_corpus`` that never finished)."""
    for folder in root.glob(f"{CONVERTING}*"):
        if _temporary_is_dead(root, folder):
            with _removal_lock(root, folder) as held:
                if held:
                    discard(folder)


def _removal_lock(root: Path, folder: Path) -> contextlib.AbstractContextManager[bool]:
    """Held while ``folder`` is removed: its key's lock (no build or verification of the key meanwhile), or for a
    conversion folder its owner file's lock (a dead one's: it has no owner left)."""
    if folder.name.startswith(CONVERTING):
        owner = folder / OWNER
        return _held_unless_busy(owner, create=False) if owner.exists() else contextlib.nullcontext(True)
    try:
        (root / "locks").mkdir(exist_ok=True)
    except OSError as error:
        raise CacheFolderError(root, error.strerror or str(error)) from None
    return _held_unless_busy(root / "locks" / f"{_key_of(folder)}.lock", create=True)


def _size(folder: Path) -> int:
    return sum(path.lstat().st_size for path in folder.rglob("*") if path.is_file())


def _temporary_is_dead(root: Path, folder: Path) -> bool:
    if folder.name.startswith(CONVERTING):
        if not (folder / OWNER).exists():
            return time.time() - folder.stat().st_mtime > OWNERLESS_GRACE_S
        with _held_unless_busy(folder / OWNER, create=False) as free:
            return free
    lock = root / "locks" / f"{_key_of(folder)}.lock"
    if not lock.exists():
        return True
    with _held_unless_busy(lock, create=False) as free:
        return free


def _key_of(folder: Path) -> str:
    return folder.name[1:].split(".", 1)[0] if folder.name.startswith(".") else folder.name


def list_entries(root: Path) -> list[Entry]:
    """Every entry and temporary folder of the cache folder ``root``, least recently used first."""
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        if folder.name == "locks" or not folder.is_dir():
            continue
        if folder.name.startswith("."):
            state = DEAD if _temporary_is_dead(root, folder) else BUILDING
            last_used = folder.stat().st_mtime
        else:
            state = COMPLETE if read_meta(folder) is not None else INCOMPLETE
            used = folder / USED
            last_used = (used if used.exists() else folder).stat().st_mtime
        found.append(Entry(folder, _size(folder), last_used, state))
    return sorted(found, key=lambda entry: (entry.last_used, entry.path.name))


def prune(root: Path, older_than_days: float, dry_run: bool = False) -> tuple[list[Entry], list[Entry]]:
    """Remove the entries of ``root`` that no run opened in the last ``older_than_days`` days, and every temporary
    folder a killed build left; returns what was removed (or, with ``dry_run``, would be) and the old entries kept
    because a build or a verification of their key holds its lock."""
    if older_than_days < 0:
        raise ValueError(f"older_than_days={older_than_days}: give a number of days, 0 or more")
    cutoff = time.time() - older_than_days * 86400
    removed, kept = [], []
    for entry in list_entries(root):
        if entry.state == BUILDING or (entry.state != DEAD and entry.last_used >= cutoff):
            continue
        with _removal_lock(root, entry.path) as held:
            if not held:
                kept.append(entry)
                continue
            removed.append(entry)
            if not dry_run:
                _remove(root, entry.path)
    return removed, kept


def _remove(root: Path, folder: Path) -> None:
    """Move ``folder`` aside in one rename (an opener never sees half of it), then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f".{_key_of(folder)}.stale-", dir=root))
    folder.rename(aside / "old")
    discard(aside)


def verify_entries(root: Path) -> list[tuple[Entry, str | None]]:
    """Every entry of ``root`` read in full and compared with its record: ``None`` where it is intact, else what is
    wrong (an incomplete entry is reported as such)."""
    results = []
    for entry in list_entries(root):
        if entry.state == COMPLETE:
            meta = read_meta(entry.path)
            damage = verify(entry.path, meta) if meta is not None else ("meta.json", "it changed")
            results.append((entry, None if damage is None else f"{damage[0]}: {damage[1]}"))
        elif entry.state == INCOMPLETE:
            results.append((entry, entry.state))
    return results
