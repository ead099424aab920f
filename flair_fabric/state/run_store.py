"""A run's ``base_path`` in object storage (``s3://``, ``gs://``, any fsspec URL): the run works in a node-local
folder, its *staging folder*, and its files are copied to the store, which is the run's truth.

A checkpoint ``checkpoints/step-<steps>/`` in the store is complete only when its completion marker ``COMPLETE`` is
there. Each node that holds files of it uploads them first and then its part marker ``.parts/node-<n>.json`` (the
files and their sizes); global rank 0 writes ``COMPLETE`` (every file of every part) last, once every node's part
marker is there. ``resume_from="auto"`` takes the newest checkpoint with its marker; one without is never read, and
``keep_checkpoints`` removes only complete ones (marker first). The run's own files (``loss.tsv``, ``best-model.pt``,
``final-model.pt``, ``config.yaml``, ...; also the files of ``best-model.adapter/`` and the like) are uploaded whole
by global rank 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flair_fabric.storage import StorageError, check_reachable, filesystem

MARKER = "COMPLETE"
PARTS = ".parts"
CHECKPOINTS = "checkpoints"
APPENDED_FILES = (".tsv", ".txt", ".log")
"""The run's own files a run appends to (``loss.tsv``, ``weights.txt``, ...): the staging folder starts with the
store's copies of them (a resumed run's, with all the run's files)."""
RUN_FOLDERS = (".adapter",)
"""The run's own folders, uploaded with its files, file by file: a model file's unmerged adapters (``save_adapters``,
``best-model.adapter/``)."""


def staging_root() -> Path:
    """``$FLAIR_FABRIC_STAGING``, or ``~/.cache/flair_fabric/runs``: where each machine keeps its staging folders."""
    configured = os.environ.get("FLAIR_FABRIC_STAGING")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "flair_fabric" / "runs"


class DamagedCheckpoint(RuntimeError):
    """A complete checkpoint's file in the store is not the size its marker lists."""


class IncompleteUpload(RuntimeError):
    """A checkpoint's parts did not all arrive in the store in time: its marker is not written."""


@dataclass(frozen=True)
class RunStore:
    """The store's folder of one run (``url``), this machine's staging folder of it (``local``) and the filesystem's
    options (``storage_options``: credentials, an endpoint; held in memory only, never written or shown)."""

    url: str
    local: Path
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> RunStore:
        """The run in ``url``, staged in ``staging_root()/<name>-<hash of the URL>`` on every machine alike."""
        url = url.rstrip("/")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", url.rsplit("/", 1)[-1])[:40] or "run"
        key = hashlib.sha256(url.encode()).hexdigest()[:16]
        return cls(url, staging_root() / f"{name}-{key}", dict(storage_options or {}))

    @property
    def fs(self) -> Any:
        return filesystem(self.url, self.storage_options, argument="base_path")

    def check_writable(self) -> None:
        """Before any process starts: the bucket exists, the credentials work, and an object can be written there
        (one is written and removed). Each mistake is one :class:`StorageError` line naming ``base_path``."""
        check_reachable(self.url, argument="base_path", expect="folder", storage_options=self.storage_options)
        probe = f"{self.url}/.flair-fabric-write-check-{uuid.uuid4().hex}"
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as error:  # the provider's own errors: denied, read-only
            raise StorageError(
                f"base_path={self.url!r} cannot be written ({type(error).__name__}): use a bucket and prefix these"
                " credentials may write to."
            ) from None

    # --- checkpoints in the store ---------------------------------------------------------------------------------

    def checkpoint_url(self, name: str) -> str:
        return f"{self.url}/{CHECKPOINTS}/{name}"

    def complete_checkpoints(self) -> list[str]:
        """The names of the run's complete checkpoints in the store (those with their marker), oldest first."""
        fs = self.fs
        fs.invalidate_cache()  # another process (or machine) may have written since this one listed
        found = fs.glob(f"{self.url}/{CHECKPOINTS}/step-*/{MARKER}")
        return sorted(str(path).rstrip("/").split("/")[-2] for path in found)

    def read_marker(self, name: str) -> dict[str, Any]:
        """A complete checkpoint's marker: its files (path in the checkpoint: size) and the save's id."""
        return dict(json.loads(self.fs.cat_file(f"{self.checkpoint_url(name)}/{MARKER}")))

    def forget(self, name: str) -> None:
        """Before a checkpoint of this name is written again: it is no longer complete (marker first)."""
        fs, url = self.fs, self.checkpoint_url(name)
        for path in (f"{url}/{MARKER}", f"{url}/{PARTS}"):
            if fs.exists(path):
                fs.rm(path, recursive=True)

    def upload_part(self, folder: Path | None, name: str, node_rank: int) -> None:
        """Upload the files of checkpoint ``name`` this node holds (in ``folder``; ``None``: none), then this node's
        part marker."""
        fs, url = self.fs, self.checkpoint_url(name)
        files = sorted(path for path in folder.rglob("*") if path.is_file()) if folder is not None else []
        sizes = {}
        for path in files:
            relative = path.relative_to(folder).as_posix()  # type: ignore[arg-type]
            fs.put_file(str(path), f"{url}/{relative}")
            sizes[relative] = path.stat().st_size
        fs.pipe_file(f"{url}/{PARTS}/node-{node_rank:05d}.json", json.dumps({"files": sizes}).encode())

    def complete(self, name: str, num_nodes: int, timeout: float, abandoned: threading.Event | None = None) -> None:
        """Global rank 0: once every node's part marker is in the store, write the checkpoint's marker (last).
        Waits ``timeout`` seconds for the parts, or until ``abandoned`` is set (a failed run)."""
        fs, url = self.fs, self.checkpoint_url(name)
        expected = [f"node-{node:05d}.json" for node in range(num_nodes)]
        deadline = time.monotonic() + timeout
        while True:
            fs.invalidate_cache(f"{url}/{PARTS}")
            present = {str(path).rsplit("/", 1)[-1] for path in fs.glob(f"{url}/{PARTS}/node-*.json")}
            if all(part in present for part in expected):
                break
            if time.monotonic() > deadline or (abandoned is not None and abandoned.is_set()):
                missing = [part for part in expected if part not in present]
                raise IncompleteUpload(f"{url}: no part from {', '.join(missing)} within {timeout:.0f} s")
            time.sleep(0.2)
        files: dict[str, int] = {}
        for part in expected:
            files.update(json.loads(fs.cat_file(f"{url}/{PARTS}/{part}"))["files"])
        marker = {"files": files, "id": uuid.uuid4().hex}
        fs.pipe_file(f"{url}/{MARKER}", json.dumps(marker, sort_keys=True).encode())

    def prune(self, keep: int) -> None:
        """Remove the oldest complete checkpoints beyond the newest ``keep``: each one's marker first."""
        fs = self.fs
        for name in self.complete_checkpoints()[:-keep]:
            url = self.checkpoint_url(name)
            fs.rm_file(f"{url}/{MARKER}")
            fs.rm(url, recursive=True)

    def download_checkpoint(self, name: str) -> Path:
        """The complete checkpoint ``name`` in the staging folder: downloaded file by file as its marker lists them
        (the marker last), unless the copy there has the same marker already. Returns the local folder."""
        fs, url = self.fs, self.checkpoint_url(name)
        marker = fs.cat_file(f"{url}/{MARKER}")
        target = self.local / CHECKPOINTS / name
        if (target / MARKER).is_file() and (target / MARKER).read_bytes() == marker:
            return target
        temporary = target.parent / f".{name}.download-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True, mode=0o700)
        for relative, size in json.loads(marker)["files"].items():
            (temporary / relative).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fs.get_file(f"{url}/{relative}", str(temporary / relative))
            (temporary / relative).chmod(0o600)
            got = (temporary / relative).stat().st_size
            if got != size:
                shutil.rmtree(temporary, ignore_errors=True)
                raise DamagedCheckpoint(
                    f"{url}/{relative} has {got} bytes, its checkpoint's marker"
                    f" {url}/{MARKER} says {size}: the checkpoint was changed after it was written and is not read."
                    f" Remove {url} (its marker first) to resume from an older checkpoint."
                )
        (temporary / MARKER).write_bytes(marker)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(temporary, target)
        return target

    # --- the run's own files --------------------------------------------------------------------------------------

    def download_run_files(self, resuming: bool) -> None:
        """Global rank 0, at the start: the staging folder's appended files (``loss.tsv``, ...) become the store's
        (those the store does not have are removed), and for a resumed run all the run's files (``best-model.pt``
        too, which the run's end may load), so a run continues the store's files on any machine."""
        fs = self.fs
        fs.invalidate_cache()
        self.local.mkdir(parents=True, exist_ok=True)
        stored = {
            str(path).rsplit("/", 1)[-1]
            for path, info in fs.find(self.url, maxdepth=1, withdirs=False, detail=True).items()
            if info.get("type") == "file"
        }
        for path in self.local.iterdir():
            if path.is_file() and path.suffix in APPENDED_FILES and path.name not in stored:
                path.unlink()
        for name in sorted(stored):
            if resuming or Path(name).suffix in APPENDED_FILES:
                partial = self.local / f".{name}.download"
                fs.get_file(f"{self.url}/{name}", str(partial))
                os.replace(partial, self.local / name)

    def _run_files(self) -> list[tuple[str, Path]]:
        """The run's own files in the staging folder, by their path in it: its files, and those in its folders
        (:data:`RUN_FOLDERS`); hidden ones (being written) and the checkpoints left out."""
        found = []
        for path in sorted(self.local.iterdir()) if self.local.is_dir() else []:
            if path.name.startswith("."):
                continue
            if path.is_file():
                found.append((path.name, path))
            elif path.is_dir() and path.suffix in RUN_FOLDERS:
                inside = sorted(each for each in path.rglob("*") if each.is_file())
                found.extend((each.relative_to(self.local).as_posix(), each) for each in inside)
        return found

    def snapshot_run_files(self, uploaded: dict[str, tuple[int, int]]) -> Path | None:
        """Global rank 0, in the training thread: the run's own files (not the checkpoints; those in its folders
        too) that changed since ``uploaded`` (path in the staging folder: size, modification time; updated) frozen in
        a new snapshot folder, to be uploaded while training goes on: appended files copied, the others (written by
        a rename) linked. ``None``: none changed."""
        changed = []
        for name, path in self._run_files():
            stat = path.stat()
            if uploaded.get(name) != (stat.st_size, stat.st_mtime_ns):
                changed.append((name, path))
                uploaded[name] = (stat.st_size, stat.st_mtime_ns)
        if not changed:
            return None
        snapshot = self.local / f".snapshot-{uuid.uuid4().hex}"
        snapshot.mkdir(mode=0o700)
        for name, path in changed:
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if path.suffix in APPENDED_FILES:
                shutil.copy2(path, snapshot / name)
            else:
                os.link(path, snapshot / name)
        return snapshot

    def upload_snapshot(self, snapshot: Path) -> None:
        """Upload a snapshot of the run's own files, each whole, and remove it."""
        fs = self.fs
        for path in sorted(each for each in snapshot.rglob("*") if each.is_file()):
            fs.put_file(str(path), f"{self.url}/{path.relative_to(snapshot).as_posix()}")
        shutil.rmtree(snapshot, ignore_errors=True)
