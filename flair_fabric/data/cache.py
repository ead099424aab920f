"""The cache of mapped corpora: one folder per content key, built once per machine under a file lock.

The key is a SHA-256 of the source files' bytes, the reading options, the format version and flair's version. A
cache folder is written under a temporary name and renamed into place, so a half-written cache is never opened and a
failed build leaves no entry. Two processes that build the same key at once: one builds, the other waits on the lock
and opens what the first wrote. A folder whose ``meta.json`` names another format version is rebuilt.

The default cache folder is ``$FLAIR_FABRIC_CACHE`` or, without it, ``~/.cache/flair_fabric/corpora``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flair

from flair_fabric.data.columns import FORMAT_VERSION
from flair_fabric.data.errors import SourceChangedError

META = "meta.json"
Stat = tuple[int, int]


def default_cache_folder() -> Path:
    """``$FLAIR_FABRIC_CACHE``, or ``~/.cache/flair_fabric/corpora``."""
    configured = os.environ.get("FLAIR_FABRIC_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "flair_fabric" / "corpora"


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
    """The meta record of a complete cache folder of this format version; ``None`` for anything else."""
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        return None
    if not all((folder / split["file"]).is_file() for split in meta.get("splits", {}).values()):
        return None
    return meta


@contextlib.contextmanager
def build_lock(root: Path, key: str) -> Iterator[None]:
    """An exclusive lock on one key for the processes of this machine (``fcntl.flock``; kept in ``root/locks``)."""
    locks = root / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def discard(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def open_or_build(root: Path, key: str, build: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any], bool]:
    """The cache folder of ``key`` under ``root``, its meta record, and whether this call built it.

    ``build(folder)`` writes the split files into an empty temporary folder and returns the meta record (splits);
    it runs at most once per key on this machine at a time, and only when no complete folder of this format exists.
    """
    folder = root / key
    meta = read_meta(folder)
    if meta is not None:
        return folder, meta, False
    with build_lock(root, key):
        meta = read_meta(folder)
        if meta is not None:
            return folder, meta, False
        if folder.exists():  # another format version, or not complete: never read, rebuilt
            stale = Path(tempfile.mkdtemp(prefix=f".{key}.stale-", dir=root))
            folder.rename(stale / "old")
            discard(stale)
        temporary = Path(tempfile.mkdtemp(prefix=f".{key}.building-", dir=root))
        try:
            meta = {"format_version": FORMAT_VERSION, "flair_version": flair.__version__, **build(temporary)}
            (temporary / META).write_text(json.dumps(meta, indent=1))
            temporary.rename(folder)
        except BaseException:
            discard(temporary)
            raise
    return folder, meta, True


def check_sources(sources: dict[str, Stat]) -> None:
    """Refuse to go on when a source file's size or modification time is not what it was when the corpus opened."""
    for path, expected in sources.items():
        try:
            now = stat_of(Path(path))
        except FileNotFoundError:
            raise SourceChangedError(path, "it was removed") from None
        if now != tuple(expected):
            raise SourceChangedError(path, f"size and mtime {tuple(expected)} then, {now} now")
