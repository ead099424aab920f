"""Cache entries built from source files or from data points already in memory: the splits stored, the sources'
sizes and times recorded, the result opened as :class:`~flair_fabric.data.split.MappedSplit`\\ s."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flair.data import DataPoint
from torch.utils.data import Dataset

from flair_fabric.data.cache import Stat, cache_root, content_key, open_or_build, stat_of
from flair_fabric.data.columns import FORMAT_VERSION
from flair_fabric.data.errors import SourceChangedError
from flair_fabric.data.housekeeping import conversion_folder, remove_dead_conversions
from flair_fabric.data.remote import Store, open_published, remote_key
from flair_fabric.data.split import MappedSplit
from flair_fabric.data.storage import write_split
from flair_fabric.storage import StorageError, is_url

log = logging.getLogger("flair")

SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class Opened:
    """A cache entry opened: its splits (``None`` where the source has none), folder, whether this call built it, and
    whether it downloaded it from the store."""

    splits: dict[str, MappedSplit | None]
    folder: Path
    built: bool
    downloaded: bool = False


def _splits(folder: Path, meta: dict[str, Any], sources: dict[str, Stat]) -> dict[str, MappedSplit | None]:
    stored = meta["splits"]
    return {
        name: MappedSplit(folder / stored[name]["file"], stored[name]["rows"], sources, meta.get("linked", False))
        if name in stored
        else None
        for name in SPLITS
    }


def from_files(
    files: dict[str, str | Path | None],
    options: dict[str, Any],
    read: Callable[[Any], Iterable[DataPoint]],
    cache_folder: str | Path | None,
    linked: bool = False,
    store: Store | None = None,
) -> Opened:
    """The cache entry of the split files ``files`` read with ``read`` (``options``: everything that changes what it
    reads), built if no entry of this content exists. With a ``store`` (sources or ``cache_folder`` in object
    storage), the entry is downloaded from it where it is published there, else built and published
    (:mod:`~flair_fabric.data.remote`)."""
    root = cache_root(None if is_url(cache_folder) else cache_folder)
    keyed = {**options, "splits": sorted(name for name, path in files.items() if path is not None)}
    if any(is_url(path) for path in files.values()):
        present: dict[str, Any] = {name: str(path) for name, path in files.items() if path is not None}
        sources: dict[str, Stat] = {}  # not watched in the store
        key = remote_key(present, keyed, store.storage_options if store else None)
    else:
        present = {name: Path(path) for name, path in files.items() if path is not None}
        sources = {str(path.resolve()): stat_of(path) for path in present.values()}
        key = content_key(list(present.values()), keyed)

    def build(folder: Path) -> dict[str, Any]:
        stored = {}
        for name, path in present.items():
            kind, rows = write_split(folder / f"{name}.arrow", read(path))
            stored[name] = {"file": f"{name}.arrow", "rows": rows, "kind": kind}
        for source, expected in sources.items():  # read after hashing: refuse what changed in between
            if stat_of(Path(source)) != expected:
                raise SourceChangedError(source, "while its cache was built")
        return {"splits": stored, "linked": linked, "sources": sources}

    if store is None:
        folder, meta, built = open_or_build(root, key, build)
        return Opened(_splits(folder, meta, sources), folder, built)
    folder, meta, how = open_published(root, key, build, store)
    return Opened(_splits(folder, meta, sources), folder, how == "built", how == "downloaded")


def _data_points(dataset: Dataset) -> Iterator[DataPoint]:
    for index in range(len(dataset)):  # type: ignore[arg-type]
        yield dataset[index]


def _linked(dataset: Dataset) -> bool:
    """Whether each sentence links to its neighbours in the split (flair's column reader links them)."""
    size, previous = len(dataset), None  # type: ignore[arg-type]
    for index in range(size):
        point = dataset[index]
        if getattr(point, "_previous_sentence", None) is not previous:
            return False
        previous = point
    return size > 0 and getattr(previous, "_next_sentence", None) is None


def from_datasets(datasets: dict[str, Dataset | None], cache_folder: str | Path | None) -> Opened:
    """The cache entry of data points already in memory, keyed by the SHA-256 of the files they are stored in
    (converted into a temporary folder first; the entry is made from it, or rebuilt from it where damaged); its cache
    folder is a local one (every process holds the corpus in memory: nothing to gain from a store)."""
    if is_url(cache_folder):
        raise StorageError(
            f"cache_folder={cache_folder!r}: map_corpus keeps its cache on this machine (every process holds the "
            "corpus already): pass a local folder, or put the corpus's files in the store and use MappedCorpus.from_*"
        )
    root = cache_root(cache_folder)
    remove_dead_conversions(root)
    with conversion_folder(root) as temporary:
        digest = hashlib.sha256(FORMAT_VERSION.encode())
        stored: dict[str, dict[str, Any]] = {}
        linked: dict[str, bool] = {}
        for name, dataset in datasets.items():
            if dataset is None:
                continue
            kind, rows = write_split(temporary / f"{name}.arrow", _data_points(dataset))
            stored[name] = {"file": f"{name}.arrow", "rows": rows, "kind": kind}
            linked[name] = _linked(dataset)
            digest.update(f"\0{name}\0".encode() + (temporary / f"{name}.arrow").read_bytes())
        every_split_linked = bool(linked) and all(linked.values())
        if not every_split_linked and _has_links(datasets):
            log.warning("map_corpus: the sentences' neighbour links do not follow the splits' order; not kept")

        def build(folder: Path) -> dict[str, Any]:
            for split in stored.values():
                (temporary / split["file"]).rename(folder / split["file"])
            return {"splits": stored, "linked": every_split_linked, "sources": {}}

        folder, meta, built = open_or_build(root, "corpus-" + digest.hexdigest(), build)
    return Opened(_splits(folder, meta, {}), folder, built)


def _has_links(datasets: dict[str, Dataset | None]) -> bool:
    for dataset in datasets.values():
        if dataset is not None and len(dataset) > 0:  # type: ignore[arg-type]
            point = dataset[0]
            if getattr(point, "_next_sentence", None) is not None:
                return True
    return False
