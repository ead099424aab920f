"""Mapped corpora and object storage: sources read from URLs, cache entries published to the store and downloaded into
the node-local cache (docs/storage.md).

Where a corpus's sources are URLs, or ``cache_folder`` is one, its cache entry has a published copy in the store:
``<data_folder>/.flair_fabric_cache/<key>/`` beside the sources, or ``<cache_folder>/<key>/``, holding the same Arrow
files and ``meta.json`` (uploaded last: a published entry without it is never read). Opening the corpus on a machine,
under the node-local lock of its key (:func:`open_published`):

- an intact entry in the node-local cache opens as before (nothing is downloaded);
- else a published entry is downloaded into a temporary folder of the node-local cache, each file hashed (SHA-256)
  against the published record, and renamed into place;
- else a process of the job's first node (node rank 0 in the environment: ``GROUP_RANK``, ``SLURM_NODEID``,
  ``NODE_RANK``; 0 where none is set) builds it, streaming the sources from the store, and publishes it; a process of
  another node waits for the published ``meta.json`` (at most ``$FLAIR_FABRIC_CORPUS_WAIT`` seconds, default 3600).

Two jobs that build the same corpus at once both build and both upload: their files are the same bytes (the key fixes
the sources, the options and the flair, format and pyarrow versions), each object is replaced whole and ``meta.json``
comes last, so the last upload wins and a reader sees one content (a mix would fail its checksums, never be read).

The key of sources in the store: their paths (without the scheme's credentials), sizes and the version tag the store
keeps (S3's ETag, GCS's MD5, ...; else the modification time), the reading options and the versions: opening an entry
built before reads no source. A source in the store is not watched while the corpus is in use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from flair.datasets.base import find_train_dev_test_files

from flair_fabric.data.cache import content_key, open_or_build
from flair_fabric.data.columns import FORMAT_VERSION
from flair_fabric.data.errors import DamagedCacheError
from flair_fabric.data.integrity import META, record_problem
from flair_fabric.storage import StorageError, check_reachable, filesystem, is_url, storage_error

log = logging.getLogger("flair")

STORE_FOLDER = ".flair_fabric_cache"
"""The folder beside a corpus's sources (in the store) that holds its published cache entries."""
WAIT_VARIABLE = "FLAIR_FABRIC_CORPUS_WAIT"
NODE_RANK_VARIABLES = ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK")
TAGS = ("ETag", "etag", "md5Hash", "crc32c", "generation", "mtime", "LastModified", "last_modified", "created")
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Store:
    """Where a corpus's cache entries are published: ``url`` (no trailing ``/``), the argument that named it, and the
    filesystem's options (never written anywhere)."""

    url: str
    argument: str
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)

    def entry(self, key: str) -> str:
        return f"{self.url}/{key}"

    def fs(self) -> Any:
        return filesystem(self.url, self.storage_options, argument=self.argument)


def store_of(
    data_folder: str | Path, cache_folder: str | Path | None, storage_options: dict[str, Any] | None
) -> Store | None:
    """The store of a corpus: ``cache_folder`` where it is a URL, else beside ``data_folder`` where that is a URL,
    else none (a local corpus); a cache URL whose bucket cannot be reached is refused now."""
    options = dict(storage_options or {})
    if is_url(cache_folder):
        url = str(cache_folder).rstrip("/")
        check_reachable(url, argument="cache_folder", storage_options=options, expect="folder")
        return Store(url, "cache_folder", options)
    if is_url(data_folder):
        return Store(f"{str(data_folder).rstrip('/')}/{STORE_FOLDER}", "data_folder", options)
    return None


def node_rank() -> int:
    """This process's node in its job, read from the environment (torchrun, SLURM, Lightning); 0 outside a job."""
    for name in NODE_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def split_files(
    data_folder: str,
    dev_file: str | Path | None,
    test_file: str | Path | None,
    train_file: str | Path | None,
    autofind_splits: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> tuple[str | None, str | None, str | None]:
    """flair's ``find_train_dev_test_files`` for a folder in the store: flair's own rules, applied to empty stand-ins
    of the folder's entries in a temporary local folder; returns the URLs of dev, test and train."""
    folder = data_folder.rstrip("/")
    fs = filesystem(folder, storage_options, argument="data_folder")
    try:
        listing = fs.ls(folder, detail=True, refresh=True)  # a listing cached by s3fs may be stale
    except FileNotFoundError:
        listing = []
    except Exception as error:  # the provider's own errors (no credentials, denied, endpoint down)
        raise storage_error(data_folder, "data_folder", error, storage_options) from None
    if not listing:
        raise StorageError(f"data_folder={data_folder!r}: no such folder (nothing under it): pass the sources' URL.")
    with tempfile.TemporaryDirectory(prefix="flair-fabric-listing-") as temporary:
        local = Path(temporary)
        for item in listing:
            name = str(item["name"]).rstrip("/").rsplit("/", 1)[-1]
            (local / name).mkdir() if item.get("type") == "directory" else (local / name).touch()
        flair_log = logging.getLogger("flair")
        level = flair_log.level
        flair_log.setLevel(logging.WARNING)  # flair logs the stand-ins' local paths
        try:
            found = find_train_dev_test_files(local, dev_file, test_file, train_file, autofind_splits)
        finally:
            flair_log.setLevel(level)
        urls = tuple(None if path is None else f"{folder}/{Path(path).relative_to(local).as_posix()}" for path in found)
    log.info("Reading data from %s: train %s, dev %s, test %s", folder, urls[2], urls[0], urls[1])
    return urls  # type: ignore[return-value]


def _tag(info: dict[str, Any], url: str, storage_options: dict[str, Any] | None) -> str:
    """The version tag the store keeps for a file, else (none kept) the SHA-256 of its bytes, streamed."""
    for name in TAGS:
        if info.get(name) not in (None, ""):
            return f"{name}={info[name]}"
    digest = hashlib.sha256()
    with filesystem(url, storage_options).open(url, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return f"sha256={digest.hexdigest()}"


def remote_key(files: dict[str, str], options: dict[str, Any], storage_options: dict[str, Any] | None) -> str:
    """The cache key of sources in the store (see the module's docstring); a source that cannot be read is one
    :class:`~flair_fabric.storage.StorageError` line naming its split's argument (``train_file``, ...) and the fix."""
    digest = hashlib.sha256(content_key([], {**options, "pyarrow": pa.__version__}).encode())
    for name, url in files.items():
        info = check_reachable(url, argument=f"{name}_file", storage_options=storage_options, expect="file")
        fs = filesystem(url, storage_options)
        plain = f"{type(fs).__name__}:{fs._strip_protocol(url)}"
        digest.update(f"\0{name}\0{plain}\0{info.get('size')}\0{_tag(info, url, storage_options)}".encode())
    return "remote-" + digest.hexdigest()


def fetch(store: Store, key: str, folder: Path) -> dict[str, Any] | None:
    """The published entry of ``key`` downloaded into ``folder`` and its record; ``None`` where none is published
    (or its record is not one this version reads: it is built and published again)."""
    fs, entry = store.fs(), store.entry(key)
    try:
        raw = fs.cat_file(f"{entry}/{META}")
    except FileNotFoundError:
        return None
    except Exception as error:
        raise storage_error(entry, store.argument, error, store.storage_options) from None
    try:
        meta = json.loads(raw)
    except ValueError:
        meta = None
    problem = record_problem(meta) or (None if meta["format_version"] == FORMAT_VERSION else "another format")
    if problem is not None:
        log.warning("published corpus entry %s: %s; building it again", entry, problem)
        return None
    names = sorted(meta["files"])
    try:
        fs.get([f"{entry}/{name}" for name in names], [str(folder / name) for name in names])
    except Exception as error:
        raise storage_error(entry, store.argument, error, store.storage_options) from None
    return dict(meta)


def wait_for(store: Store, key: str, folder: Path) -> dict[str, Any]:
    """:func:`fetch`, retried every second until the entry is published (by the job's first node)."""
    limit = float(os.environ.get(WAIT_VARIABLE, "3600"))
    deadline = time.monotonic() + limit
    log.info("waiting for the first node to publish the corpus's cache entry %s", store.entry(key))
    while (meta := fetch(store, key, folder)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {limit:.0f} s for {store.entry(key)}/{META}, which a process of the job's first node (node "
                f"rank 0) builds and publishes: open the same corpus there, or raise {WAIT_VARIABLE}"
            )
        time.sleep(POLL_SECONDS)
    return meta


def publish(store: Store, key: str, folder: Path, meta: dict[str, Any]) -> None:
    """Upload the entry sealed in ``folder``: its split files, then ``meta.json`` (the published entry's completion
    marker). A failed upload removes what it uploaded and is one line naming the place and the fix."""
    fs, entry = store.fs(), store.entry(key)
    uploaded: list[str] = []
    try:
        fs.makedirs(entry, exist_ok=True)  # a filesystem with folders (file://); nothing in a bucket
        for name in [*sorted(meta["files"]), META]:
            fs.put_file(str(folder / name), f"{entry}/{name}")
            uploaded.append(f"{entry}/{name}")
    except Exception as error:
        with contextlib.suppress(Exception):
            if uploaded:
                fs.rm(uploaded)
        problem = str(storage_error(entry, store.argument, error, store.storage_options)).split(": ", 1)[1]
        reason = "access denied" if isinstance(error, PermissionError) else problem.rstrip(".")
        place = f"{store.argument}={store.url.removesuffix('/' + STORE_FOLDER)!r}"
        raise StorageError(
            f"{place}: the corpus's cache entry cannot be published to {entry} ({reason}): pass cache_folder= a URL "
            "this job may write to"
        ) from None


@dataclass
class _Fill:
    """How the entry of one open came to be: ``"built"`` from the sources or ``"downloaded"``, and the published
    record it was downloaded with."""

    how: str = ""
    published: dict[str, Any] = field(default_factory=dict)


def open_published(
    root: Path, key: str, build: Callable[[Path], dict[str, Any]], store: Store
) -> tuple[Path, dict[str, Any], str]:
    """The node-local entry of ``key`` (see the module's docstring), its record, and how this call got it:
    ``"opened"`` (it was there), ``"downloaded"`` or ``"built"`` (and published)."""
    filled = _Fill()

    def fill(temporary: Path) -> dict[str, Any]:
        published = fetch(store, key, temporary)
        if published is None and node_rank() != 0:
            published = wait_for(store, key, temporary)
        if published is None:
            filled.how = "built"
            return build(temporary)
        filled.how, filled.published = "downloaded", published
        return {name: value for name, value in published.items() if name not in _SEALED}

    def finish(temporary: Path, sealed: dict[str, Any]) -> None:
        if filled.how == "built":
            publish(store, key, temporary, sealed)
            return
        for name, record in filled.published["files"].items():
            if sealed["files"].get(name) != record:
                fix = f"remove {store.entry(key)} from the store: the next open builds and publishes it again"
                raise DamagedCacheError(f"{store.entry(key)}/{name}", "not what its published record says", fix)

    folder, meta, _ = open_or_build(root, key, fill, finish)
    return folder, meta, filled.how or "opened"


_SEALED = ("format_version", "flair_version", "files", "checksum")
"""The fields of a record that the node-local seal writes itself."""
