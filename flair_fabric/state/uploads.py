"""Uploads to a run's store off the training thread: one background thread per machine (on each node's local rank 0).

A checkpoint is written to the staging folder, then uploaded while training goes on; the next checkpoint waits only
if the previous upload is still running, and a run that ends waits for its uploads. A failed upload is raised in the
training thread at the next wait, naming the store.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from flair_fabric.state.run_store import RunStore

log = logging.getLogger("flair")


class UploadError(RuntimeError):
    """An upload to the run's store failed."""


class Uploads:
    """This machine's uploads of one run: checkpoint parts (every node), the run's own files and the checkpoints'
    markers (global rank 0)."""

    def __init__(
        self, store: RunStore, *, node_rank: int, num_nodes: int, is_global_zero: bool, keep: int, timeout: float
    ) -> None:
        self.store, self.node_rank, self.num_nodes = store, node_rank, num_nodes
        self.is_global_zero, self.keep, self.timeout = is_global_zero, keep, timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flair-fabric-upload")
        self._pending: list[Future] = []
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._abandoned = threading.Event()

    def wait(self) -> None:
        """Wait for the uploads started so far; raise :class:`UploadError` if one failed."""
        pending, self._pending = self._pending, []
        for future in pending:
            error = future.exception()
            if error is not None:
                raise UploadError(f"uploading to base_path={self.store.url!r} failed: {error}") from error

    def before_checkpoint(self, name: str) -> None:
        """Before checkpoint ``name`` is written: the previous upload is done, and a checkpoint of the same name in
        the store is no longer complete (global rank 0; every node waits for its own upload)."""
        self.wait()
        if self.is_global_zero:
            self.store.forget(name)

    def checkpoint(self, folder: Path | None, name: str) -> None:
        """Upload this node's files of checkpoint ``name`` (``folder``, ``None`` when it holds none) in the background;
        global rank 0 then writes the marker once every node's part is there, prunes beyond ``keep`` and uploads the
        run's changed files."""
        snapshot = self.store.snapshot_run_files(self._uploaded) if self.is_global_zero else None
        self._pending.append(self._executor.submit(self._upload_checkpoint, folder, name, snapshot))

    def _upload_checkpoint(self, folder: Path | None, name: str, snapshot: Path | None) -> None:
        self.store.upload_part(folder, name, self.node_rank)
        if self.is_global_zero:
            self.store.complete(name, self.num_nodes, self.timeout, self._abandoned)
            self.store.prune(self.keep)
            if snapshot is not None:
                self.store.upload_snapshot(snapshot)
            log.info(f"checkpoint {name} is complete in {self.store.url}")

    def run_files(self) -> None:
        """Upload the run's changed files (global rank 0: model files, ``loss.tsv``, ...) in the background."""
        if self.is_global_zero:
            snapshot = self.store.snapshot_run_files(self._uploaded)
            if snapshot is not None:
                self._pending.append(self._executor.submit(self.store.upload_snapshot, snapshot))

    def finish(self) -> None:
        """At the run's end: upload the run's changed files and wait for every upload."""
        self.run_files()
        self.wait()
        self._executor.shutdown()

    def abandon(self) -> None:
        """A run that failed: the running upload ends (its parts; global rank 0 stops waiting for other machines'
        parts, and a checkpoint without its marker stays incomplete); uploads not started are dropped."""
        self._abandoned.set()
        self._executor.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def all_uploaded(uploads: Uploads | None) -> Iterator[None]:
    """The block's run ends with its uploads in the store: after the block every upload is waited for; a block that
    fails (or is preempted) lets what is uploading now arrive and raises on. ``None``: no store, nothing to do."""
    if uploads is None:
        yield
        return
    try:
        yield
    except BaseException:
        uploads.abandon()
        raise
    uploads.finish()
