"""The cache of mapped corpora: one folder per content key, built once per machine under a file lock.

The key is a SHA-256 of the source files' bytes, the reading options, the format version and flair's version. A
cache folder is written under a temporary name and renamed into place, so a half-written cache is never opened and a
failed build leaves no entry. Two processes that build the same key at once: one builds, the other waits on the lock
and opens what the first wrote. A folder whose ``meta.json`` names another format version is rebuilt, and so is one
whose files are not what its record says (:mod:`~flair_fabric.data.integrity`). A build holding the lock removes
what killed builds of its key left (``.<key>.building-*``). Each open touches ``<entry>/used`` (the last use that
``python -m flair_fabric cache list|prune`` read).

The default cache folder is ``$FLAIR_FABRIC_CACHE`` or, without it, ``~/.cache/flair_fabric/corpora``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flair

from flair_fabric.data.columns import FORMAT_VERSION
from flair_fabric.data.errors import CacheFolderError, DamagedCacheError, SourceChangedError
from flair_fabric.data.integrity import META, file_problem, mark_built, record_problem, seal, trusted, verify

USED = "used"
Stat = tuple[int, int]
Finish = Callable[[Path, dict[str, Any]], None]
log = logging.getLogger("flair")
_CHECKED: dict[str, dict[str, Any]] = {}
"""The entries this process has verified (folder -> meta record): later opens compare each file's size only."""


def default_cache_folder() -> Path:
    """``$FLAIR_FABRIC_CACHE``, or ``~/.cache/flair_fabric/corpora``."""
    configured = os.environ.get("FLAIR_FABRIC_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "flair_fabric" / "corpora"


def cache_root(cache_folder: str | Path | None) -> Path:
    """The cache folder to use (``cache_folder``, else :func:`default_cache_folder`), made where missing; one that
    cannot be made raises :class:`~flair_fabric.data.errors.CacheFolderError` naming it and the fix."""
    root = Path(cache_folder) if cache_folder is not None else default_cache_folder()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CacheFolderError(root, error.strerror or str(error)) from None
    return root


def stat_of(path: Path) -> Stat:
    """A source file's size and modification time (ns): what a run compares to notice a change."""
    status = os.stat(path)
    return status.st_size, status.st_mtime_ns


def content_key(sources: list[Path], options: dict[str, Any]) -> str:
    """The cache key: SHA-256 over the sources' bytes, ``options`` (JSON), the format and flair versions."""
    digest = hashlib.sha256()
    head = {"format": FORMAT_VERSION, "flair": flair.__version__, "options": options}
    digest.update(json.dumps(head, sort_keys=True, default=repr).encode())
    for source in sources:
        digest.update(b"\0file\0")
        with open(source, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def read_meta(folder: Path) -> dict[str, Any] | None:
    """The meta record of a complete cache folder of this format version, its own checksum intact; ``None`` for
    anything else (the split files are checked by :func:`open_or_build`)."""
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        return None
    return meta if record_problem(meta) is None else None


@contextlib.contextmanager
def build_lock(root: Path, key: str) -> Iterator[None]:
    """An exclusive lock on one key for the processes of this machine (``fcntl.flock``; kept in ``root/locks``)."""
    locks = root / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        handle = open(locks / f"{key}.lock", "a")  # noqa: SIM115 (closed below)
    except OSError as error:
        raise CacheFolderError(root, error.strerror or str(error)) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def discard(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def remove_dead_temporaries(root: Path, key: str) -> None:
    """The temporary folders of ``key`` (``.<key>.building-*``, ``.<key>.stale-*``): under the key's lock no build
    of it runs on this machine, so they are what a killed build left."""
    for path in root.glob(f".{key}.*"):
        discard(path)


def _move_aside(root: Path, key: str, folder: Path) -> None:
    stale = Path(tempfile.mkdtemp(prefix=f".{key}.stale-", dir=root))
    folder.rename(stale / "old")
    discard(stale)


def mark_used(folder: Path) -> None:
    """Record that a run opened the entry now (the modification time of ``folder/used``; not on a read-only cache)."""
    with contextlib.suppress(OSError):
        (folder / USED).touch()


def _remember(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    _CHECKED[str(folder)] = meta
    mark_used(folder)
    return meta


def open_or_build(
    root: Path, key: str, build: Callable[[Path], dict[str, Any]], finish: Finish | None = None
) -> tuple[Path, dict[str, Any], bool]:
    """The cache folder of ``key`` under ``root``, its meta record, and whether this call built it.

    ``build(folder)`` writes the split files into an empty temporary folder and returns the meta record (splits);
    it runs at most once per key on this machine at a time, and only when no complete, intact folder of this format
    exists: an entry whose files are not what its record says is rebuilt (and logged), never read. ``finish(folder,
    record)`` runs once the temporary folder is sealed, before it is renamed into place (an error discards it).
    """
    folder = root / key
    meta = read_meta(folder)
    if meta is not None and trusted(folder, meta):
        return folder, _remember(folder, meta), False
    try:
        with build_lock(root, key):
            return _open_or_build_locked(root, key, build, finish)
    except CacheFolderError:  # a read-only cache folder: an intact entry opens, nothing can be built
        if meta is not None and verify(folder, meta) is None:
            return folder, _remember(folder, meta), False
        raise


def _open_or_build_locked(
    root: Path, key: str, build: Callable[[Path], dict[str, Any]], finish: Finish | None
) -> tuple[Path, dict[str, Any], bool]:
    folder = root / key
    remove_dead_temporaries(root, key)
    meta = read_meta(folder)
    if meta is not None:  # verified meanwhile by the process this one waited for, or read in full now
        damage = None if trusted(folder, meta) else verify(folder, meta)
        if damage is None:
            return folder, _remember(folder, meta), False
        log.warning("cache entry %s: %s is damaged (%s); rebuilding it from its sources", folder, *damage)
    if folder.exists():  # damaged, another format version, or not complete: never read, rebuilt
        _move_aside(root, key, folder)
    try:
        temporary = Path(tempfile.mkdtemp(prefix=f".{key}.building-", dir=root))
    except OSError as error:
        raise CacheFolderError(root, error.strerror or str(error)) from None
    try:
        record = {"format_version": FORMAT_VERSION, "flair_version": flair.__version__, **build(temporary)}
        meta = seal(temporary, record)
        if finish is not None:
            finish(temporary, meta)
        (temporary / USED).touch()
        temporary.rename(folder)
    except BaseException:
        discard(temporary)
        raise
    mark_built(folder, meta)
    return folder, _remember(folder, meta), True


def _fix(folder: Path) -> str:
    return (
        "Open the corpus again from its sources (MappedCorpus.from_* with the same files, or map_corpus), which "
        f"rebuilds the entry; where the sources are gone, remove {folder} and build it from restored sources"
    )


def _lock_if_writable(root: Path, key: str) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    with contextlib.suppress(CacheFolderError):  # a read-only cache: verified without the lock
        stack.enter_context(build_lock(root, key))
    return stack


def _checked_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as error:
        raise DamagedCacheError(folder / META, f"not readable: {error}", _fix(folder)) from None
    problem = record_problem(meta)
    if problem is not None:
        raise DamagedCacheError(folder / META, problem, _fix(folder))
    if not trusted(folder, meta):
        with _lock_if_writable(folder.parent, folder.name):
            damage = None if trusted(folder, meta) else verify(folder, meta)
        if damage is not None:
            raise DamagedCacheError(folder / damage[0], damage[1], _fix(folder))
    _CHECKED[str(folder)] = meta
    return meta


def checked_file(path: Path) -> None:
    """Before a split file is memory-mapped: its entry's record intact and the entry verified (in full once per
    machine, see :mod:`~flair_fabric.data.integrity`), the file's size as recorded. A split cannot rebuild its
    entry: a damaged one raises :class:`~flair_fabric.data.errors.DamagedCacheError` naming the file and the fix."""
    folder = path.parent
    remembered = _CHECKED.get(str(folder))
    if remembered is None or _size_problem(path, remembered) is not None:
        problem = _size_problem(path, _checked_meta(folder))
        if problem is not None:
            raise DamagedCacheError(path, problem, _fix(folder))


def _size_problem(path: Path, meta: dict[str, Any]) -> str | None:
    record = meta["files"].get(path.name)
    return "it is not in its entry's record" if record is None else file_problem(path, record, full=False)


def check_sources(sources: dict[str, Stat]) -> None:
    """Refuse to go on when a source file's size or modification time is not what it was when the corpus opened."""
    for path, expected in sources.items():
        try:
            now = stat_of(Path(path))
        except FileNotFoundError:
            raise SourceChangedError(path, "it was removed") from None
        if now != tuple(expected):
            raise SourceChangedError(path, f"size and mtime {tuple(expected)} then, {now} now")
