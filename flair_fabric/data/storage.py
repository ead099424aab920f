"""Arrow IPC files of stored rows: written in record batches while the source is read, opened memory-mapped."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
from flair.data import DataPoint

from flair_fabric.data.columns import FORMAT_VERSION, encode, kind_of, schema

ROWS_PER_BATCH = 1024


class FormatVersionError(RuntimeError):
    """A stored file of another format version (never read)."""


def write_split(path: Path, data_points: Iterable[DataPoint], kind: str | None = None) -> tuple[str, int]:
    """Write ``data_points`` (all of one kind) to the Arrow IPC file ``path``, ``ROWS_PER_BATCH`` rows at a time.

    The kind is that of the first data point unless given (an empty split is a split of sentences). Returns the kind
    and the number of rows."""
    rows: list[dict] = []
    count = 0
    writer: pa.ipc.RecordBatchFileWriter | None = None
    try:
        for data_point in data_points:
            if kind is None:
                kind = kind_of(data_point)
            if writer is None:
                layout = schema(kind)
                writer = pa.ipc.new_file(str(path), layout)
            rows.append(encode(data_point, kind))
            count += 1
            if len(rows) == ROWS_PER_BATCH:
                writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=layout))
                rows = []
        kind = kind or "sentence"
        layout = schema(kind)
        if writer is None:
            writer = pa.ipc.new_file(str(path), layout)
        if rows:
            writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=layout))
    finally:
        if writer is not None:
            writer.close()
    return kind, count


def open_split(path: Path) -> tuple[pa.Table, str]:
    """The table of a stored split, memory-mapped (no copy of the data on the heap), and its kind."""
    reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    metadata = reader.schema.metadata or {}
    version = metadata.get(b"flair_fabric_format", b"?").decode()
    if version != FORMAT_VERSION:
        raise FormatVersionError(f"{path} has format version {version}, this flair-fabric reads {FORMAT_VERSION}")
    return reader.read_all(), metadata[b"kind"].decode()
